import functools
import hashlib
import http.server
import threading

import pytest

from gptlib.data import download
from gptlib.data.download import TINYSHAKESPEARE_SHA256, PrepareError, fetch_tinyshakespeare


@pytest.fixture()
def http_dir(tmp_path, shakespeare_path, monkeypatch):
    """A local HTTP server: these machines have no internet, the download code path still runs."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "input.txt").write_bytes(shakespeare_path.read_bytes())
    (root / "wrong.txt").write_bytes(b"not shakespeare\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(download, "TINYSHAKESPEARE_URL", f"{base}/input.txt")
    yield base, root
    server.shutdown()


def test_download_verifies_and_caches(tmp_path, http_dir):
    base, root = http_dir
    cache = tmp_path / "cache"
    p = fetch_tinyshakespeare(cache_dir=cache)
    assert hashlib.sha256(p.read_bytes()).hexdigest() == TINYSHAKESPEARE_SHA256
    assert len(p.read_text()) == 1_115_394
    (root / "input.txt").unlink()  # the second call must not need the network
    assert fetch_tinyshakespeare(cache_dir=cache) == p


def test_checksum_mismatch_is_refused_and_not_cached(tmp_path, http_dir, monkeypatch):
    base, _ = http_dir
    monkeypatch.setattr(download, "TINYSHAKESPEARE_URL", f"{base}/wrong.txt")
    with pytest.raises(PrepareError, match="sha256 is .* expected 86c4e6aa"):
        fetch_tinyshakespeare(cache_dir=tmp_path / "c")
    assert not (tmp_path / "c" / "tinyshakespeare.txt").exists()


def test_corrupt_cache_is_replaced(tmp_path, http_dir):
    base, _ = http_dir
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "tinyshakespeare.txt").write_text("corrupt")
    p = fetch_tinyshakespeare(cache_dir=cache)
    assert hashlib.sha256(p.read_bytes()).hexdigest() == TINYSHAKESPEARE_SHA256


def test_unreachable_url_explains_the_local_option(tmp_path, monkeypatch):
    # nothing listens: refused
    monkeypatch.setattr(download, "TINYSHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    with pytest.raises(PrepareError, match="could not download.*pass a local copy") as e:
        fetch_tinyshakespeare(cache_dir=tmp_path)
    # options that exist (it advised fetch-shakespeare's nonexistent --input)
    assert (
        "(fetch-shakespeare --local PATH or tokenize --input PATH; notebook 02: TEXT_PATH)"
        in str(e.value)
    )
    with pytest.raises(PrepareError, match="is a folder, not the file"):
        fetch_tinyshakespeare(local_path=tmp_path)


def test_local_copy_is_verified(tmp_path, shakespeare_path):
    assert fetch_tinyshakespeare(local_path=shakespeare_path) == shakespeare_path
    bad = tmp_path / "bad.txt"
    bad.write_text("x")
    with pytest.raises(PrepareError, match="bad.txt: sha256"):
        fetch_tinyshakespeare(local_path=bad)
