"""mkdocs hook: the configs reference page (`reference/configs.md`), generated from the code at each build."""

import os

from mkdocs.structure.files import File

from areal_jax import config_reference


def on_files(files, config):
  root = os.path.dirname(config["config_file_path"])
  files.append(File.generated(config, "reference/configs.md", content=config_reference.reference_markdown(root)))
  return files
