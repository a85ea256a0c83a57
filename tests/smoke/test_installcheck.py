"""The install guard: no file of the environment belongs to two distributions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from preshard_devenv import installcheck

# Lines of the real RECORDs of cuda-python 12.6.2.post1 (which still shipped the bindings) and
# cuda-bindings 13.5.0: the pair the lock once held. Both write cuda/bindings/runtime.*.so, with
# different contents; the empty __init__.pxd they share is the same file in both.
_RUNTIME = "cuda/bindings/runtime.cpython-311-x86_64-linux-gnu.so"
_EMPTY = "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0"
_CUDA_PYTHON_12 = [
    f"cuda/__init__.pxd,{_EMPTY}",
    "cuda/__init__.py,sha256=54QcsAmayKpvRhITFEpC44LSKswIY6M0rU7srjz6AlA,423",
    f"cuda/bindings/__init__.pxd,{_EMPTY}",
    f"{_RUNTIME},sha256=roevnQPf6gkP03hvx5dTwF-c-dadeyzrujXYFrd_7-A,26969288",
    "cuda/bindings/__pycache__/__init__.cpython-311.pyc,,",
]
_CUDA_BINDINGS_13 = [
    f"cuda/bindings/__init__.pxd,{_EMPTY}",
    f"{_RUNTIME},sha256=9xTxWn1aq1yzQOazZKjZYK3oi1tIXsBLSGkuE22oz30,4682440",
    "cuda/bindings/__pycache__/__init__.cpython-311.pyc,,",
]


def _install(site: Path, name: str, version: str, records: list[str]) -> None:
    """A dist-info directory as an installer leaves it: METADATA, and a RECORD naming itself."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    own = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join([*records, *own]) + "\n")


def _guard(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preshard_devenv", "check-install", "--site-packages", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_two_distributions_writing_the_cuda_bindings_fail_the_guard(tmp_path: Path) -> None:
    _install(tmp_path, "cuda-python", "12.6.2.post1", _CUDA_PYTHON_12)
    _install(tmp_path, "cuda-bindings", "13.5.0", _CUDA_BINDINGS_13)
    result = _guard(tmp_path)
    assert result.returncode == 1, result.stdout
    assert (
        f"cuda-bindings 13.5.0 and cuda-python 12.6.2.post1 both install {_RUNTIME} "
        "(and 1 more file)"
    ) in result.stderr
    assert "__pycache__" not in result.stderr
    assert ".dist-info" not in result.stderr


def test_the_metapackage_release_shares_no_file(tmp_path: Path) -> None:
    # From 13.0 on, cuda-python is a metapackage: its RECORD names only its own metadata.
    _install(tmp_path, "cuda-python", "13.4.4", [])
    _install(tmp_path, "cuda-bindings", "13.4.4", _CUDA_BINDINGS_13)
    result = _guard(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no file is installed by two distributions" in result.stdout


def test_only_the_listed_distributions_may_share_an_allowed_path(tmp_path: Path) -> None:
    shared = "build_backend.py,sha256=WUgBRce7i-K7htTdoJJ2OVPSLVUAVv8Dv-cEta8gT4k,3802"
    _install(tmp_path, "flashinfer-python", "0.7.4", [shared])
    _install(tmp_path, "torch_c_dlpack_ext", "0.1.5", [shared])
    assert installcheck.find_overlaps([tmp_path]) == []
    _install(tmp_path, "other", "1.0", [shared])
    [overlap] = installcheck.find_overlaps([tmp_path])
    assert overlap.paths == ("build_backend.py",)
    assert overlap.describe() == (
        "flashinfer-python 0.7.4 and other 1.0 and torch_c_dlpack_ext 0.1.5 all install "
        "build_backend.py"
    )


def test_the_installed_environment_passes_the_guard() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "preshard_devenv", "check-install"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
