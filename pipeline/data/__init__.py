"""Reading shards for training and evaluation, as a package.

- `format.py`: the shard folder format (manifest name and version, `check_tokenizer`,
  `DataError`), shared with `data_prep/`;
- `shard_io.py`: shard folders at fsspec URLs (`read_manifest`), sha256 checks of shards;
- `loader.py`: the resumable loader (`build_loader`, `ShardLoader`, its state); the sample order
  in `order.py`, packing and dealing rows to DP ranks in `rows.py`, reading in `reader.py`.

The names below are the package's public API; import the rest from its module.
"""
from pipeline.data.format import FORMAT_VERSION, MANIFEST, DataError, check_tokenizer
from pipeline.data.shard_io import read_manifest
from pipeline.data.loader import PACKINGS, ShardLoader, best_fit_decreasing, build_loader, next_fit

__all__ = ["FORMAT_VERSION", "MANIFEST", "DataError", "check_tokenizer", "read_manifest",
           "PACKINGS", "ShardLoader", "best_fit_decreasing", "build_loader", "next_fit"]
