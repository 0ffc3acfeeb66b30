"""Model files through one region: safetensors files (and a model directory's side files) in, the same
files out, byte-identical.

The sender's half: :func:`discover` (which files a directory sends) and :func:`plan_load` / :func:`fill`
(files into one region: ``TensorRegion.from_safetensors``; :class:`Loader` in the background, so a
send starts while the files are read).  The receiver's half: :func:`plan_files`
(the offer's file layout, checked as hostile input before anything is allocated),
:func:`check_output_dir` / :func:`clean_leftovers` (at start) and
:func:`write_files` / :class:`ModelWriter` (all or nothing; the writer starts while the bytes land).  Modules:

- :mod:`~tensorxfer.files.format`    the safetensors header format and safe file names
- :mod:`~tensorxfer.files.sources`   directories -> tensor files, side files, what is left out
- :mod:`~tensorxfer.files.layout`    how files travel in the manifest's metadata; the receiver's check
- :mod:`~tensorxfer.files.load`      files -> one region (host, or GPU through pinned staging)
- :mod:`~tensorxfer.files.write`     region -> files, all or nothing (temporary names, fsync, rename, rollback)
"""

from tensorxfer.files.format import FileFormatError, OutputError, check_name, parse_header, read_header
from tensorxfer.files.layout import FILES_KEY, FilePlan, plan_files
from tensorxfer.files.load import Loader, LoadPlan, fill, plan_load
from tensorxfer.files.sources import Discovery, Source, discover
from tensorxfer.files.write import (
    ModelWriter,
    check_free_space,
    check_other_model,
    check_output_dir,
    clean_leftovers,
    write_files,
)

__all__ = [
    "FILES_KEY",
    "Discovery",
    "FileFormatError",
    "FilePlan",
    "LoadPlan",
    "Loader",
    "ModelWriter",
    "OutputError",
    "Source",
    "check_free_space",
    "check_name",
    "check_other_model",
    "check_output_dir",
    "clean_leftovers",
    "discover",
    "fill",
    "parse_header",
    "plan_files",
    "plan_load",
    "read_header",
    "write_files",
]
