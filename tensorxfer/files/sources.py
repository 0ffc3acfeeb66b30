"""Which files a model directory sends: its tensor files, its side files, and what is left out.

A model directory sends the safetensors files its index names (or, without
an index, every ``*.safetensors`` in it) and its *side files*
(``config.json``, ``generation_config.json``, tokenizer files, the index,
...: every other regular top-level file, bounded by
:data:`MAX_SIDE_FILE_BYTES` each and :data:`MAX_SIDE_TOTAL_BYTES` in all),
so a Hugging Face directory arrives loadable.  Symlinks are followed only
inside the directory (a hub snapshot: inside its repository folder).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensorxfer.files.format import FileFormatError, check_name, loads

MAX_INDEX_BYTES = 16 << 20          # model.safetensors.index.json of a million tensors
MAX_SIDE_FILE_BYTES = 32 << 20      # one side file (the largest tokenizer.json we know is ~17 MB)
MAX_SIDE_TOTAL_BYTES = 48 << 20     # all side files together (they travel in the manifest's metadata)
INDEX_NAME = "model.safetensors.index.json"
#: Other serializations of the weights found beside safetensors files: not side files, never sent.
OTHER_WEIGHT_SUFFIXES = frozenset((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".ot",
                                   ".tflite", ".pkl", ".npz", ".nemo"))
#: Side files that belong to a model (configs, tokenizers): in an output directory, another model's.
MODEL_SIDE_FILES = frozenset(("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                              "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "vocab.json",
                              "vocab.txt", "merges.txt", "preprocessor_config.json", "processor_config.json",
                              "chat_template.json", "chat_template.jinja", "adapter_config.json"))
#: What every refusal of another weight format says: which formats are sent, and what to do.
SENT_FORMATS = ("only safetensors files carry weights here (*.safetensors; a model directory also sends its "
                "side files: config.json, tokenizer files, ...); other weight formats ("
                + ", ".join(sorted(OTHER_WEIGHT_SUFFIXES)) + ") are not sent: save the model as safetensors "
                "first, e.g. transformers' save_pretrained(DIR, safe_serialization=True)")


@dataclass(frozen=True)
class Source:
    """One file to send: its name on the receiver, where it is here, and how it travels."""

    name: str
    path: Path
    kind: str          # "safetensors" (tensors in the region) or "side" (bytes in the metadata)


@dataclass
class Discovery:
    """What :func:`discover` found: the files to send, and what it left out (name, reason)."""

    files: list[Source]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def is_model_file(name: str) -> bool:
    """Whether a file of this name is part of a model: weights in any format, an index, a config or
    tokenizer file (:data:`MODEL_SIDE_FILES`).  A README or a file of the user's is not."""
    suffix = Path(name).suffix.lower()
    return (suffix == ".safetensors" or suffix in OTHER_WEIGHT_SUFFIXES or name.endswith(".index.json")
            or name in MODEL_SIDE_FILES)


def _allowed_root(directory: Path) -> Path:
    """Where symlinks inside ``directory`` may point: the directory itself, or for a Hugging Face
    hub snapshot (``models--org--name/snapshots/<rev>``, whose files link to ``../../blobs``) the
    repository folder."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _inside(path: Path, root: Path) -> Path:
    real = path.resolve()
    if real != root and root not in real.parents:
        raise FileFormatError(f"{path} is a symlink to {real}, outside {root}: refusing to send it (copy the file "
                              f"into the directory, or remove the link)")
    return real


def _read_index(index: Path) -> list[str]:
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise FileFormatError(f"{index}: {size} bytes, over the {MAX_INDEX_BYTES}-byte limit for an index")
    try:
        text = index.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{index}: not UTF-8 text: {e}") from None
    obj = loads(text, str(index), "index")
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FileFormatError(f"{index}: not a usable index (needs a non-empty \"weight_map\" object)")
    return sorted({check_name(v) for v in weight_map.values()})


def discover(sources: Sequence[str | os.PathLike[str]]) -> Discovery:
    """Every file to send: files as given, directories expanded.

    A directory sends its tensor files — those its
    ``model.safetensors.index.json`` ``weight_map`` names, or without an
    index every ``*.safetensors`` in it — and every other regular top-level
    file as a side file (configs, tokenizer files, the index itself).  Left
    out, and listed in :attr:`Discovery.skipped`: hidden files,
    subdirectories, other weight formats (``.bin``, ``.pt``, ...),
    ``*.safetensors`` the index does not name, and anything that is not a
    regular file.  A symlink is followed only when it stays inside the
    directory (for a Hugging Face hub snapshot: inside its repository
    folder).  A file given by name is a tensor file if it ends in
    ``.safetensors``, refused if it is another weight format
    (:data:`OTHER_WEIGHT_SUFFIXES`), else a side file; at least one tensor
    file must be among the sources.

    Raises
    ------
    FileFormatError
        No safetensors file, a file in another weight format named
        directly, duplicate output names, unsafe names, an unusable index,
        a symlink pointing outside the directory, or side files over
        :data:`MAX_SIDE_FILE_BYTES` / :data:`MAX_SIDE_TOTAL_BYTES`.
    FileNotFoundError
        A source does not exist.
    """
    found = Discovery([])
    for src in sources:
        p = Path(src)
        if p.is_dir():
            _discover_dir(p, found)
        elif p.is_file():
            name = check_name(p.name)
            if p.suffix.lower() in OTHER_WEIGHT_SUFFIXES:
                raise FileFormatError(f"{p}: {p.suffix} is not safetensors; {SENT_FORMATS}")
            found.files.append(Source(name, p, "safetensors" if p.suffix == ".safetensors" else "side"))
        elif p.exists() or p.is_symlink():
            raise FileFormatError(f"{p}: not a regular file or directory")
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    names = [s.name for s in found.files]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise FileFormatError(f"several sources would be written as {sorted(dup)}; send them separately")
    if not any(s.kind == "safetensors" for s in found.files):
        given = ", ".join(s.name for s in found.files) or "nothing"
        raise FileFormatError(f"no safetensors file to send (the sources hold {given}); {SENT_FORMATS}")
    side = [(s, s.path.stat().st_size) for s in found.files if s.kind == "side"]
    for s, size in side:
        if size > MAX_SIDE_FILE_BYTES:
            raise FileFormatError(f"{s.path}: {size} bytes, over the {MAX_SIDE_FILE_BYTES}-byte limit for a side "
                                  f"file (side files travel in the transfer's metadata); move it out of the "
                                  f"directory or send the *.safetensors files by name")
    total = sum(size for _, size in side)
    if total > MAX_SIDE_TOTAL_BYTES:
        raise FileFormatError(f"side files add up to {total} bytes, over the {MAX_SIDE_TOTAL_BYTES}-byte limit "
                              f"({', '.join(s.name for s, _ in side)}); move some out of the directory")
    return found


def _discover_dir(d: Path, found: Discovery) -> None:
    root = _allowed_root(d)
    index = d / INDEX_NAME
    tensor_names = _read_index(_inside(index, root)) if index.is_file() else None
    entries = sorted(d.iterdir(), key=lambda q: q.name)
    if tensor_names is None:
        tensor_names = [q.name for q in entries if q.suffix == ".safetensors" and q.is_file()]
        if not tensor_names:
            others = [q.name for q in entries if q.suffix.lower() in OTHER_WEIGHT_SUFFIXES]
            held = f" (it holds {', '.join(others)})" if others else ""
            raise FileFormatError(f"{d}: no *.safetensors files in this directory{held}; {SENT_FORMATS}")
    wanted = set(tensor_names)
    for n in tensor_names:
        q = d / n
        if not q.is_file():
            raise FileFormatError(f"{index}: names {n!r}, which is not a file in {d}")
        _inside(q, root)
        found.files.append(Source(check_name(n), q, "safetensors"))
    for q in entries:
        if q.name in wanted:
            continue
        if q.name.startswith("."):
            found.skipped.append((q.name, "hidden"))
        elif q.is_dir():
            found.skipped.append((q.name + "/", "subdirectory; only top-level files are sent"))
        elif q.suffix == ".safetensors":
            found.skipped.append((q.name, f"not named by {INDEX_NAME}"))
        elif q.suffix.lower() in OTHER_WEIGHT_SUFFIXES:
            found.skipped.append((q.name, "another weight format; the safetensors files carry the weights"))
        elif q.is_symlink() and not q.exists():
            found.skipped.append((q.name, "dangling symlink"))
        else:
            if not stat.S_ISREG(_inside(q, root).stat().st_mode):
                found.skipped.append((q.name, "not a regular file"))
                continue
            found.files.append(Source(check_name(q.name), q, "side"))

