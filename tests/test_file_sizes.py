"""No module of the four packages passes 500 lines: a file that grows past that is usually two
jobs, and a newcomer should be able to read any one file at a sitting."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_packing", "cp_attention", "longctx_moe", "rl_hooks")
MAX_LINES = 500


def long_files(root: Path, limit: int) -> list[str]:
    """'path: N lines' for every .py file under the packages of `root` longer than `limit`."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_package_file_passes_500_lines():
    assert long_files(ROOT, MAX_LINES) == [], "split these files by job"


def test_the_count_sees_a_long_file(tmp_path):
    (tmp_path / "rl_hooks").mkdir()
    (tmp_path / "rl_hooks" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "rl_hooks" / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path, MAX_LINES) == [f"{Path('rl_hooks/big.py')}: {MAX_LINES + 1} lines"]
