"""The wheels the GPU machine lacks: which (setup.py vs the image's packages), which versions, what is in .whl/.

    python bench/gpu/wheels.py list            # name==version of each wheel to carry (versions from this venv)
    python bench/gpu/wheels.py check           # setup.py's needs are all in the image or in wheels.txt
    python bench/gpu/wheels.py verify .whl     # one cp312/pure-Python wheel per pin, nothing else
    python bench/gpu/wheels.py summary .whl    # the one-line size summary (with what else travels)
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS_TXT = HERE / "wheels.txt"
IMAGE_TXT = HERE / "image_packages.txt"
LIMIT_MIB = 64.0
"""What one device call may carry: the working tree plus carried paths."""
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix",
}
"""The GPU machine, for evaluating requirement markers."""


def norm(name: str) -> str:
    """PEP 503 normalised name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> list[str]:
    """Names of a one-name-a-line list (``#`` comments and blank lines skipped), normalised."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(norm(line))
    return out


def install_requires(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """``INSTALL_REQUIRES`` of setup.py, read without running it."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INSTALL_REQUIRES" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise SystemExit(f"{setup_py}: no INSTALL_REQUIRES list")


def _requires(name: str, extras: tuple[str, ...]) -> list[str]:
    """Names ``name`` needs on the GPU machine (markers evaluated for Python 3.12, with ``extras``)."""
    from packaging.requirements import Requirement

    try:
        reqs = md.distribution(name).requires or []
    except md.PackageNotFoundError:
        return []
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in ("", *extras)):
            out.append(text)
    return out


def closure_errors(setup_py: Path = ROOT / "setup.py") -> tuple[dict[str, str], list[str]]:
    """Every name the project needs that the image lacks (name -> who needs it), and the list's errors."""
    from packaging.requirements import Requirement

    image, listed = set(read_names(IMAGE_TXT)), read_names(WHEELS_TXT)
    needed: dict[str, str] = {}
    errors: list[str] = []
    todo = [(Requirement(r), "setup.py") for r in install_requires(setup_py)]
    seen: set[str] = set()
    while todo:
        req, parent = todo.pop(0)
        name = norm(req.name)
        if name in image or name in seen:
            continue
        seen.add(name)
        needed[name] = parent
        if name not in listed:
            errors.append(f"{name} (needed by {parent}) is neither in the GPU image ({IMAGE_TXT.name}) "
                          f"nor in {WHEELS_TXT.name}")
        todo += [(Requirement(r), name) for r in _requires(name, tuple(sorted(req.extras)))]
    for name in listed:
        if name in image:
            errors.append(f"{name} is in {WHEELS_TXT.name} but the GPU image has it ({IMAGE_TXT.name})")
        elif name not in needed:
            errors.append(f"{name} is in {WHEELS_TXT.name} but nothing in setup.py needs it")
    if len(set(listed)) != len(listed):
        errors.append(f"{WHEELS_TXT.name} names a package twice")
    return needed, errors


def pins() -> list[str]:
    """``name==version`` of each listed wheel, the version installed here (what the CPU suite tests)."""
    out = []
    for name in read_names(WHEELS_TXT):
        try:
            out.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} ({WHEELS_TXT.name}) is not installed in {sys.prefix}: run `make venv`") from None
    return out


def parse_wheel(path: Path) -> tuple[str, str, list[str]]:
    """(normalised name, version, tags) of a wheel file name."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"{path.name}: not a wheel file name")
    return norm(parts[0]), parts[1], parts[-3:]


def tag_ok(tags: list[str]) -> bool:
    """A wheel the GPU machine's CPython 3.12 on x86-64 Linux installs."""
    py, abi, plat = (set(t.split(".")) for t in tags)
    return (bool(py & {"cp312", "py3", "py312"}) and bool(abi & {"cp312", "abi3", "none"})
            and (plat == {"any"} or any("x86_64" in p and "linux" in p for p in plat)))


def verify(folder: Path, want: list[str]) -> list[str]:
    """Errors of ``folder`` against the pins ``want``: missing, extra, second versions, wrong tags."""
    want_map = dict(p.split("==") for p in want)
    errors, have = [], {}
    for whl in sorted(folder.glob("*.whl")):
        try:
            name, version, tags = parse_wheel(whl)
        except ValueError as e:
            errors.append(str(e))
            continue
        if name in have:
            errors.append(f"two wheels of {name}: {have[name]} and {whl.name} (pip refuses to install both)")
        have[name] = whl.name
        if name not in want_map:
            errors.append(f"{whl.name}: not in {WHEELS_TXT.name}")
        elif version != want_map[name]:
            errors.append(f"{whl.name}: version {version}, want {want_map[name]}")
        if not tag_ok(tags):
            errors.append(f"{whl.name}: not installable by CPython 3.12 on x86-64 Linux")
    errors += [f"{n}=={v}: no wheel in {folder}" for n, v in want_map.items() if n not in have]
    return errors


def travelling_bytes() -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return sum((ROOT / p).stat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def summary(folder: Path) -> tuple[str, bool]:
    """The one-line summary and whether repo + wheels fit the per-call limit."""
    wheels = sorted(folder.glob("*.whl"))
    whl_mib = sum(w.stat().st_size for w in wheels) / 2**20
    repo_mib = travelling_bytes() / 2**20
    total = whl_mib + repo_mib
    fits = total < LIMIT_MIB
    line = (f"prepare: {len(wheels)} wheels, {whl_mib:.1f} MiB in {folder.name}/ + {repo_mib:.1f} MiB of repo = "
            f"{total:.1f} MiB of {LIMIT_MIB:.0f} MiB per call: {'fits' if fits else 'DOES NOT FIT'}")
    return line, fits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=["list", "check", "verify", "summary", "have", "prune"])
    p.add_argument("folder", nargs="?", default=str(ROOT / ".whl"))
    p.add_argument("pin", nargs="?", help="have: name==version")
    a = p.parse_args(argv)
    folder = Path(a.folder)
    if a.cmd == "list":
        print("\n".join(pins()))
        return 0
    if a.cmd == "check":
        _, errors = closure_errors()
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1 if errors else 0
    if a.cmd == "have":  # is this pin's wheel already there (exit 0) or not (1)
        name, version = a.pin.split("==")
        return 0 if any(parse_wheel(w)[:2] == (norm(name), version) for w in folder.glob("*.whl")) else 1
    if a.cmd == "prune":  # remove wheels of other versions or of names no longer listed
        want = dict(p.split("==") for p in pins())
        for w in folder.glob("*.whl"):
            name, version, _ = parse_wheel(w)
            if want.get(name) != version:
                print(f"prepare: removing {w.name} (not in the list at this version)")
                w.unlink()
        return 0
    if a.cmd == "verify":
        errors = verify(folder, pins())
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1 if errors else 0
    line, fits = summary(folder)
    print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
