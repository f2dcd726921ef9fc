"""pipeline.common.atomic_io: the shared atomic writer (mode, replacement, failure leaves the old file)."""
import json
import os
import stat

import pytest

from pipeline.common import atomic_io


def test_written_files_get_the_umask_mode_not_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        import importlib
        importlib.reload(atomic_io)          # the module reads the umask at import
        atomic_io.write_json(tmp_path / "a" / "r.json", {"x": 1})
        atomic_io.write_text(tmp_path / "a" / "r.md", "é\n")
        with atomic_io.atomic_path(tmp_path / "a" / "f.png", suffix=".png") as tmp:
            assert tmp.endswith(".png")
            open(tmp, "wb").write(b"\x89PNG")
    finally:
        os.umask(old)
        importlib.reload(atomic_io)
    for name in ("r.json", "r.md", "f.png"):
        assert stat.S_IMODE((tmp_path / "a" / name).stat().st_mode) == 0o644, name
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == {"x": 1}
    assert (tmp_path / "a" / "r.md").read_text(encoding="utf-8") == "é\n"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["f.png", "r.json", "r.md"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "state.json"
    atomic_io.write_json(p, {"step": 1}, fsync=True)
    with pytest.raises(TypeError):
        atomic_io.write_json(p, {"step": object()})          # JSON cannot hold it
    with pytest.raises(KeyboardInterrupt):
        with atomic_io.atomic_path(p) as tmp:
            open(tmp, "w").write('{"step": 2')                # half written, then interrupted
            raise KeyboardInterrupt
    assert json.loads(p.read_text()) == {"step": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["state.json"]
