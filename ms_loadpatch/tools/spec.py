"""What a benchmark or verify run loads: a checkpoint directory, the model
class (inferred from config.json) and how to call it; no mindspore import."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

DTYPES = ("float16", "bfloat16", "float32")


class UsageError(Exception):
    """Bad input from the user (path, class, option): the commands exit 2."""


@dataclasses.dataclass
class LoadSpec:
    """A checkpoint and how to call from_pretrained on it.

    class_name: a class of mindone.transformers / mindone.diffusers, or
    "module:Class" for a subclass of one (imported in the child).
    library: "transformers" or "diffusers" as read from config.json; the
    child decides from the class itself.
    """

    path: str
    class_name: str
    library: str
    subfolder: str = ""
    dtype: str | None = None
    single_file: str = ""  # a diffusers model's file in model_dir, loaded with from_single_file

    @property
    def model_dir(self) -> str:
        return os.path.join(self.path, self.subfolder) if self.subfolder else self.path

    @classmethod
    def resolve(cls, path, class_name=None, subfolder=None, dtype=None, single_file=None) -> "LoadSpec":
        """Check the path and infer the class from config.json (no mindspore import).
        Raises UsageError with a message for the user."""
        path = os.path.abspath(os.fspath(path))
        subfolder = subfolder or ""
        if dtype is not None and dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if not os.path.isdir(path):
            raise UsageError(f"{path}: not a directory (a local checkpoint directory is needed)")
        model_dir = os.path.join(path, subfolder) if subfolder else path
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(config_path):
            index = os.path.join(path, "model_index.json")
            if not subfolder and os.path.isfile(index):
                components = sorted(
                    k for k, v in _read_json(index).items() if isinstance(v, list) and not k.startswith("_")
                )
                raise UsageError(
                    f"{path} is a diffusers pipeline; pass one model with --subfolder (components: {', '.join(components)})"
                )
            raise UsageError(f"{model_dir}: no config.json")
        config = _read_json(config_path)
        if "_class_name" in config or "_diffusers_version" in config:
            library = "diffusers"
            inferred = config.get("_class_name")
        else:
            library = "transformers"
            architectures = config.get("architectures") or []
            inferred = architectures[0] if architectures else None
        name = class_name or inferred
        if not name:
            key = "_class_name" if library == "diffusers" else "architectures"
            raise UsageError(f"{config_path} names no model class ({key!r} is missing); pass --class")
        if single_file:
            if library != "diffusers":
                raise UsageError(f"--single-file loads a mindone.diffusers model; {config_path} is a {library} one")
            if not os.path.isfile(os.path.join(model_dir, single_file)):
                raise UsageError(f"{os.path.join(model_dir, single_file)}: no such file")
        return cls(
            path=path, class_name=name, library=library, subfolder=subfolder, dtype=dtype, single_file=single_file or ""
        )

    def weight_files(self) -> list[str]:
        """The safetensors files the load reads (the single file; else the index's, else every file)."""
        if self.single_file:
            return [os.path.join(self.model_dir, self.single_file)]
        try:
            names = sorted(os.listdir(self.model_dir))
        except OSError:
            return []
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if indexes:
            files = set()
            for index in indexes:
                files.update(_read_json(os.path.join(self.model_dir, index)).get("weight_map", {}).values())
            return [os.path.join(self.model_dir, f) for f in sorted(files)]
        return [os.path.join(self.model_dir, n) for n in names if n.endswith(".safetensors")]

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.weight_files() if os.path.exists(f))

    def casts(self) -> bool:
        """Whether the load may cast: no dtype asked for (the library's
        default decides), or some floating tensor of the files is in another."""
        wanted = _SAFETENSORS_DTYPES.get(self.dtype)
        if wanted is None:
            return True
        for path in self.weight_files():
            try:
                with open(path, "rb") as f:
                    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            except (OSError, ValueError):
                return True
            dtypes = {v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
            if any(d in _FLOATING and d != wanted for d in dtypes):
                return True
        return False


_SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_FLOATING = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def _read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{path}: not a JSON object")
    return value


def distribution_version(distribution: str) -> str:
    """The installed version of `distribution`, or "" when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""
