"""What the newest allowed versions change against a lock: run by ``make test-latest`` in its scratch venv.

    python locks/drift.py locks/cpu-dev.txt

Prints one line per package whose installed version differs from the lock's pin (``name: lock -> now``),
then those installed but not in the lock and those locked but not installed; exit code 0 either way, since
drift alone is no failure (the smoke tests that follow decide that).
"""

import importlib.metadata
import re
import sys

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock_path: str) -> dict[str, str]:
    with open(lock_path, encoding="utf-8") as lock:
        return {canonical(match[1]): match[2] for match in map(PIN.match, lock) if match}


def installed_versions() -> dict[str, str]:
    return {canonical(dist.metadata["Name"]): dist.version for dist in importlib.metadata.distributions()}


def main(lock_path: str) -> None:
    locked, installed = locked_versions(lock_path), installed_versions()
    for own in ("areal-hpc", "pip"):  # the project itself and the venv's installer are not locked
        installed.pop(own, None)
    changed = sorted(name for name in locked.keys() & installed.keys() if locked[name] != installed[name])
    print(
        f"drift against {lock_path}: {len(changed)} changed, "
        f"{len(installed.keys() - locked.keys())} new, {len(locked.keys() - installed.keys())} gone"
    )
    for name in changed:
        print(f"  {name}: {locked[name]} -> {installed[name]}")
    for name in sorted(installed.keys() - locked.keys()):
        print(f"  {name}: new, {installed[name]}")
    for name in sorted(locked.keys() - installed.keys()):
        print(f"  {name}: gone (locked {locked[name]})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python locks/drift.py LOCK_FILE (e.g. locks/cpu-dev.txt)", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
