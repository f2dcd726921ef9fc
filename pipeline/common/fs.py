"""fsspec filesystems for URLs, with one-line errors for a missing filesystem package.

Owns: which package provides which protocol (`FS_PACKAGES`) and the wording of a URL whose
filesystem cannot be made. Used by data preparation (inputs, output folder) and by the shard
loader (`pipeline.data.shard_io`).
"""
from __future__ import annotations

# fsspec protocol -> the package that provides its filesystem (docs/TRAINING.md "Reading the shards")
FS_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
               "https": "aiohttp", "abfs": "adlfs", "az": "adlfs", "hf": "huggingface_hub",
               "sftp": "paramiko", "ssh": "paramiko"}


def missing_fs_package(url: str, error: BaseException) -> str:
    """One line for a URL whose fsspec filesystem cannot be made (`url_to_fs` raised `error`,
    an ImportError for a missing package or a ValueError for an unknown protocol)."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, ImportError):
        pkg = FS_PACKAGES.get(protocol)
        hint = f"pip install {pkg}" if pkg else "install the fsspec package for it"
        return (f"the {protocol}:// filesystem needs a package that is not installed ({detail}); "
                f"{hint}")
    return detail
