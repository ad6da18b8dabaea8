"""A local Cloud Storage emulator for tests: `gcp-storage-emulator` (PyPI) on a free loopback port, in memory.

    with gcs_emulator.running(bucket="test-bucket") as url:   # environment set for tensorstore, gcsfs/etils, google-cloud-storage
      ...                                                     # gs://test-bucket/... works in this process and its children

The emulator omits two things real GCS does and tensorstore's OCDBT (Orbax's array format) relies on: media downloads
carry the object's generation in `x-goog-generation`, and `ifGenerationMatch` / `ifGenerationNotMatch` on a download
answer 412 / 304. Run as a script, this module starts the emulator with its download handler wrapped to add both;
everything else is the emulator's own behaviour.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request

from waiting import wait_until

# Read by tensorstore (Orbax's arrays) and by gcsfs (etils paths: files and listings).
ENV_VARS = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "STORAGE_EMULATOR_HOST",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(*, bucket: str, timeout_s: float = 30.0):
  """Starts the emulator with `bucket` created, points this process's environment at it, and stops it after."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--port={port}", f"--bucket={bucket}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  saved = {k: os.environ.get(k) for k in ENV_VARS}
  try:
    def serving() -> bool:
      try:
        with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}", timeout=1):
          return True
      except OSError:
        if proc.poll() is not None:
          raise RuntimeError(f"GCS emulator exited with code {proc.returncode} before serving {url}") from None
        return False

    wait_until(serving, timeout_s=timeout_s, what=f"the GCS emulator serving {url}", poll_s=0.1)
    os.environ.update({"TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
                       "STORAGE_EMULATOR_HOST": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
    yield url
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _serve(port: int, bucket: str) -> None:
  from http import HTTPStatus  # pylint: disable=g-import-not-at-top

  from gcp_storage_emulator import server  # pylint: disable=g-import-not-at-top
  from gcp_storage_emulator.exceptions import NotFound  # pylint: disable=g-import-not-at-top
  from gcp_storage_emulator.handlers import objects  # pylint: disable=g-import-not-at-top

  plain_download = objects.download

  def download(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
      return plain_download(request, response, storage, *args, **kwargs)
    generation = str(obj["generation"])
    response["x-goog-generation"] = generation
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    match = request.query.get("ifGenerationMatch", [None])[0]
    not_match = request.query.get("ifGenerationNotMatch", [None])[0]
    if match is not None and match != generation:
      response.status = HTTPStatus.PRECONDITION_FAILED
    elif not_match is not None and not_match == generation:
      response.status = HTTPStatus.NOT_MODIFIED
    else:
      plain_download(request, response, storage, *args, **kwargs)

  objects.download = download  # `objects.get` (JSON API with alt=media) calls the module's `download`
  server.HANDLERS = tuple((regex, {m: download if h is plain_download else h for m, h in handlers.items()})
                          for regex, handlers in server.HANDLERS)
  server.create_server("127.0.0.1", port, True, bucket).run()


if __name__ == "__main__":
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--bucket", required=True)
  flags = parser.parse_args()
  _serve(flags.port, flags.bucket)
