"""Lazy `mindone.transformers` / `mindone.transformers.models`.

The eager import is the reference: in fresh processes (tests/_lazy_probe.py),
the same names resolve to the same objects, dir() (before any access, after
the Auto classes were resolved, right after a from_pretrained, after every
name was touched), `import *`, the Auto mappings and the registries written
at import are equal; pickling, importlib, absolute imports inside model
modules and a full from_pretrained behave as eagerly. The mechanics (statement order, star
imports, fallbacks) are also checked in this process on small synthetic
packages, which need no mindone.
"""

import importlib.util
import json
import os
import sys
import textwrap
import types

# Imported at collection, with conftest's plugin on, as a script importing
# ms_loadpatch first does: the packages this suite's tests use are the lazy
# ones whatever test ran earlier in the process (some disable the plugin).
import mindone.transformers.models  # noqa: E402,F401
import pytest
from _helpers import TESTS_DIR, report_of, run_python, tiny_qwen2_config

from ms_loadpatch import eager_import_scan, lazy_import, versions

PROBE = os.path.join(TESTS_DIR, "_lazy_probe.py")


def _probe(lazy, *parts, model=None):
    # eager: the plugin imported with MS_LOADPATCH=0, i.e. not enabled (no lazy import)
    options = ["--plugin"] + ([f"--model={model}"] if model else [])
    proc = run_python([PROBE, *options, *parts], env_extra=None if lazy else {"MS_LOADPATCH": "0"}, timeout=900)
    return report_of(proc)


@pytest.fixture(scope="module")
def both_sides():
    if not versions.check().ok:
        pytest.skip("versions refused by the gate: the plugin (and lazy import) is off")
    eager = _probe(False, "hf", "names", "auto", "registries")  # "hf" first: right after the import
    lazy = _probe(True, "hf", "names", "auto", "registries")
    assert lazy["lazy_import"]["on"], lazy["lazy_import"]
    for name in versions.LAZY_IMPORT_PACKAGES:
        assert lazy["lazy_import"]["packages"][name]["state"] == "lazy", lazy["lazy_import"]
        assert eager["lazy_import"]["packages"][name]["state"] == "eager"
    return eager, lazy


@pytest.mark.matrix
def test_same_names_resolve_to_the_same_objects(both_sides):
    eager, lazy = both_sides[0]["names"], both_sides[1]["names"]
    assert (eager["type"], lazy["type"]) == ("module", "LazyPackage")
    assert not eager["hasattr_missing"] and not lazy["hasattr_missing"]
    assert lazy["not_canonical"] == eager["not_canonical"]  # HF's transformers module is replaced in sys.modules
    assert set(lazy["resolved"]) == set(eager["resolved"])
    different = {k: (v, lazy["resolved"][k]) for k, v in eager["resolved"].items() if lazy["resolved"][k] != v}
    assert not different
    assert lazy["dir_after"] == eager["dir_after"]
    assert lazy["models_dir_after"] == eager["models_dir_after"]
    assert lazy["star"] == eager["star"]
    assert lazy["has_all"] == eager["has_all"] == [False, False]
    assert lazy["missing"] == eager["missing"] == [False, False]
    assert lazy["modules"] == eager["modules"]  # the same modules once every name was touched


@pytest.mark.matrix
def test_dir_before_touching_is_the_eager_one(both_sides):
    """Every name the `__init__`s bind, and the submodules the eager import
    binds as a side effect (imported by a module it runs, or exported by a
    star import: `modeling_arcee`, `trainer_utils`, `models.align`, ...)."""
    eager, lazy = both_sides[0]["names"], both_sides[1]["names"]
    assert _difference(lazy["dir_before"], eager["dir_before"]) == ([], [])
    assert _difference(lazy["models_dir_before"], eager["models_dir_before"]) == ([], [])
    assert set(eager["dir_before"]) == set(eager["dir_after"])  # eagerly, nothing appears later
    # some of those side-effect names (mindone 0.5.0), listed before any access
    assert {"modeling_arcee", "trainer_utils", "optimization", "data"} <= set(lazy["dir_before"])
    assert {"align", "whisper"} <= set(lazy["models_dir_before"])


def _difference(lazy, eager):
    """(names only eager lists, names only lazy lists)."""
    return sorted(set(eager) - set(lazy)), sorted(set(lazy) - set(eager))


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    import mindone.transformers as mt

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    directory = tmp_path_factory.mktemp("lazy-dir") / "qwen2"
    with cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(str(directory))
    return str(directory)


# not in the matrix: the lazy packages read mindone's sources, whatever mindspore's version
def test_dir_right_after_a_load_is_the_eager_one(tiny_qwen2):
    if not versions.check().ok:
        pytest.skip("versions refused by the gate")
    eager = _probe(False, "load", "dir", model=tiny_qwen2)
    lazy = _probe(True, "load", "dir", model=tiny_qwen2)
    assert lazy["lazy_import"]["packages"]["mindone.transformers"]["state"] == "lazy"
    assert (
        lazy["load"]["class"]
        == eager["load"]["class"]
        == ["mindone.transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"]
    )
    assert lazy["load"]["parameters"] == eager["load"]["parameters"] > 0
    assert not lazy["load"]["scanned"]  # a load does not call dir(): it does not pay for the prediction
    (eager_dir,), (lazy_dir,) = eager["dir"], lazy["dir"]
    assert _difference(lazy_dir["mt"], eager_dir["mt"]) == ([], [])
    assert _difference(lazy_dir["models"], eager_dir["models"]) == ([], [])


def test_dir_before_and_after_resolving_the_auto_classes_is_the_eager_one():
    if not versions.check().ok:
        pytest.skip("versions refused by the gate")
    eager = _probe(False, "dir", "access", "dir")
    lazy = _probe(True, "dir", "access", "dir")
    assert lazy["access"] == eager["access"]
    assert not lazy["dir"][0]["scanned_before"] and lazy["dir"][1]["scanned_before"]  # on the first dir()
    for eager_dir, lazy_dir in zip(eager["dir"], lazy["dir"]):
        assert _difference(lazy_dir["mt"], eager_dir["mt"]) == ([], [])
        assert _difference(lazy_dir["models"], eager_dir["models"]) == ([], [])


@pytest.mark.matrix
def test_auto_mappings_are_equal(both_sides):
    eager, lazy = both_sides[0]["auto"], both_sides[1]["auto"]
    assert set(lazy) == set(eager)
    for key in eager:
        assert lazy[key] == eager[key], key
    assert sum(len(m) for m in lazy["lazy_auto_mappings"].values()) > 100
    assert lazy["auto_classes"]["AutoModelForCausalLM"][1] == "AutoModelForCausalLM"


@pytest.mark.matrix
def test_registries_written_at_import_are_equal(both_sides):
    eager, lazy = both_sides[0]["registries"], both_sides[1]["registries"]
    assert lazy == eager
    assert len(eager["ALL_LAYERNORM_LAYERS"]) > 2 and eager["image_processor_extra"]
    assert not both_sides[1]["lazy_import"]["side_effect_errors"]


@pytest.mark.matrix
def test_hugging_face_lazy_packages_are_left_as_eagerly(both_sides):
    eager, lazy = both_sides[0]["hf"], both_sides[1]["hf"]
    assert lazy == eager  # mindone 0.5.0 + transformers 4.57.1: transformers.models.auto.modeling_auto


@pytest.mark.matrix
def test_model_packages_import_first_in_any_order():
    """Lazily, a model package may be the first thing imported (eagerly,
    models/__init__ imports them all, in its order): reverse order works."""
    if not versions.check().ok:
        pytest.skip("versions refused by the gate")
    report = _probe(True, "reverse")
    assert report["lazy_import"]["packages"]["mindone.transformers.models"]["state"] == "lazy"
    assert report["reverse"] == {}
    report = _probe(True, "reverse-root")  # the package's other submodules, likewise
    assert report["lazy_import"]["packages"]["mindone.transformers"]["state"] == "lazy"
    assert report["reverse-root"] == {}


def test_lazy_import_off_by_environment():
    code = textwrap.dedent(
        """
        import json, sys, ms_loadpatch, mindone.transformers as mt
        print("REPORT", json.dumps({"type": type(mt).__name__, "status": ms_loadpatch.status()["lazy_import"],
                                    "finder": any(type(f).__name__ == "_Finder" for f in sys.meta_path)}))
        """
    )
    report = report_of(run_python(code, env_extra={"MS_LOADPATCH_LAZY_IMPORT": "0"}))
    assert report["type"] == "module" and not report["finder"]
    assert report["status"]["on"] is False and report["status"]["reason"] == "MS_LOADPATCH_LAZY_IMPORT=0"
    assert report["status"]["packages"]["mindone.transformers"]["state"] == "eager"


def test_import_ms_loadpatch_imports_neither_mindspore_nor_mindone():
    code = (
        "import sys, json, ms_loadpatch; print('REPORT', json.dumps({'modules': sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('mindspore', 'mindone')), 'first': type(sys.meta_path[0]).__name__, "
        "'status': ms_loadpatch.status()['lazy_import']}))"
    )
    report = report_of(run_python(code))
    assert report["modules"] == []
    assert report["first"] == "_Finder"
    assert report["status"]["on"] is True
    assert all(row["state"] == "not imported" for row in report["status"]["packages"].values())


def test_pickle_importlib_absolute_imports_and_disable():
    code = textwrap.dedent(
        """
        import importlib, json, pickle, sys
        import ms_loadpatch
        import mindone.transformers as mt
        out = {"type": type(mt).__name__}
        # a model module importing from the package root, first thing after the lazy import
        phi4 = importlib.import_module("mindone.transformers.models.phi4_multimodal.processing_phi4_multimodal")
        out["absolute"] = phi4.AutoImageProcessor is mt.AutoImageProcessor
        qwen2 = importlib.import_module("mindone.transformers.models.qwen2")
        out["submodule"] = qwen2 is mt.models.qwen2 and sys.modules["mindone.transformers.models.qwen2"] is qwen2
        out["pickle"] = pickle.loads(pickle.dumps(mt.Qwen2ForCausalLM)) is mt.Qwen2ForCausalLM
        out["same_class"] = mt.Qwen2ForCausalLM is qwen2.modeling_qwen2.Qwen2ForCausalLM
        out["hasattr"] = [hasattr(mt, "LlamaModel"), hasattr(mt, "NoSuchThing"), hasattr(mt.models, "llama")]
        ms_loadpatch.disable()
        out["after_disable"] = [type(mt).__name__, mt.BertModel.__name__,
                                any(type(f).__name__ == "_Finder" for f in sys.meta_path),
                                ms_loadpatch.status()["lazy_import"]["on"]]
        print("REPORT", json.dumps(out))
        """
    )
    report = report_of(run_python(code))
    assert report == {
        "type": "LazyPackage",
        "absolute": True,
        "submodule": True,
        "pickle": True,
        "same_class": True,
        "hasattr": [True, False, True],
        "after_disable": ["LazyPackage", "BertModel", False, False],
    }


def test_unparsable_init_falls_back_to_eager_and_status_says_why():
    code = textwrap.dedent(
        """
        import contextlib, io, json
        import ms_loadpatch
        from ms_loadpatch import cli, lazy_import

        def broken(*args, **kwargs):
            raise lazy_import.Unsupported("simulated: an __init__ the parser does not understand")

        lazy_import._Plan.build = broken
        import mindone.transformers as mt
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["status"])
        print("REPORT", json.dumps({"type": type(mt).__name__, "model": mt.Qwen2ForCausalLM.__name__,
                                    "status": ms_loadpatch.status()["lazy_import"], "text": out.getvalue()}))
        """
    )
    report = report_of(run_python(code))
    assert report["type"] == "module" and report["model"] == "Qwen2ForCausalLM"
    row = report["status"]["packages"]["mindone.transformers"]
    assert row["state"] == "eager" and "simulated" in row["reason"]
    assert "mindone.transformers: imported eagerly: Unsupported: simulated" in report["text"]


@pytest.mark.matrix
def test_from_pretrained_under_lazy_import_is_bit_identical_to_unpatched_eager(tmp_path):
    if not versions.check().ok:
        pytest.skip("versions refused by the gate")
    child = textwrap.dedent(
        """
        import json, pickle, sys
        import ms_loadpatch
        import mindone.transformers as mt
        import transformers as hf
        from ms_loadpatch import testing
        from ms_loadpatch.strategy.reports import last_report

        mode, directory, snap = sys.argv[1:4]
        if mode == "write":
            config = hf.Qwen2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
            testing.write_random_checkpoint(mt.Qwen2ForCausalLM, config, directory)
        with testing.cpu_kernel_fallbacks():
            model = mt.AutoModelForCausalLM.from_pretrained(directory)
        state = testing.snapshot(model)
        if mode == "write":
            pickle.dump(state, open(snap, "wb"))
            differences = []
        else:
            differences = testing.compare(pickle.load(open(snap, "rb")), state)
        print("REPORT", json.dumps({"type": type(mt).__name__, "accelerated": last_report() is not None,
                                    "differences": differences[:20], "tensors": len(state["tensors"])}))
        """
    )
    script = tmp_path / "child.py"
    script.write_text(child)
    directory, snap = str(tmp_path / "qwen2"), str(tmp_path / "eager.pkl")
    eager = report_of(run_python([str(script), "write", directory, snap], env_extra={"MS_LOADPATCH": "0"}))
    lazy = report_of(run_python([str(script), "load", directory, snap]))
    assert eager["type"] == "module" and not eager["accelerated"]
    assert lazy["type"] == "LazyPackage" and lazy["accelerated"]
    assert lazy["tensors"] == eager["tensors"] > 0
    assert lazy["differences"] == []


# --- the mechanics, on synthetic packages (no mindone needed)

_FILES = {
    "__init__.py": '''
        """A package shaped like mindone's: relative imports, checks, assignments."""
        __version__ = "1"
        import os
        from .a import A, shared
        from .sub import *
        if os.sep:
            from .b import B
        else:
            from .b import NotThere
        shared = "assigned later"
        from .c import shared as shared2
        from . import sub2
        NAME_OF_A = A.__name__
        try:
            from .d import D
        except ImportError:
            D = None
        ''',
    "a.py": "class A:\n    pass\nshared = 'from a'\n",
    "b.py": "class B:\n    pass\n",
    "c.py": "shared = 'from c'\n",
    "d.py": "class D:\n    pass\n",
    "sub2.py": "Y = 1\n",
    "unused.py": "Z = 1\n",
    "sub/__init__.py": "from .impl import *\n",
    "sub/impl.py": "__all__ = [\n    'S1',\n    'S2',\n]  # a literal over lines\n"
    "class S1:\n    pass\nclass S2:\n    pass\nclass Hidden:\n    pass\n",
}


def _write_package(root, name, files):
    for relative, text in files.items():
        path = os.path.join(root, name, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))


def _import_lazy(root, name):
    directory = os.path.join(root, name)
    init = os.path.join(directory, "__init__.py")
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[directory], loader=lazy_import._LazyInitLoader(name, init)
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(name, files=_FILES):
        _write_package(str(tmp_path), name, files)
        names.append(name)
        return str(tmp_path)

    yield make
    for name in names:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        lazy_import._plans.pop(name, None)
        lazy_import._packages.pop(name, None)
        eager_import_scan._eager_bound.pop(name, None)
        eager_import_scan._eager_bound_errors.pop(name, None)


def _view(module):
    """What a user sees, with the package's own name taken out."""
    prefix = module.__name__

    def show(value):
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__.replace(prefix, "P"))
        if isinstance(value, type):
            return ("class", value.__module__.replace(prefix, "P"), value.__qualname__)
        if isinstance(value, (str, int, type(None))):
            return value
        return type(value).__name__

    skip = {"__name__", "__file__", "__cached__", "__spec__", "__loader__", "__path__", "__builtins__", "__package__"}
    return {k: show(getattr(module, k)) for k in dir(module) if k not in skip}


def test_synthetic_package_matches_its_eager_import(synthetic):
    root = synthetic("eagerpkg")
    synthetic("lazypkg")
    eager = importlib.import_module("eagerpkg")
    lazy = _import_lazy(root, "lazypkg")
    assert type(lazy) is lazy_import.LazyPackage
    plan = lazy_import._plans["lazypkg"]
    # checks and assignments ran at import, in order; a name one needs was resolved for it
    assert lazy.__dict__["NAME_OF_A"] == "A" and lazy.__dict__["shared"] == "assigned later"
    assert "B" in plan.table and "S1" in plan.table and "lazypkg.d" in sys.modules  # try/except: as written
    assert "lazypkg.b" not in sys.modules and "lazypkg.sub" not in sys.modules
    assert "NotThere" not in dir(lazy) and not hasattr(lazy, "NotThere")
    assert not hasattr(lazy, "nope") and not plan.complete  # an unknown name costs nothing
    assert lazy.S1.__name__ == "S1" and "impl" in lazy.__dict__  # the star unit brings its submodule
    assert not hasattr(lazy, "Hidden")
    assert not hasattr(lazy, "unused") and not hasattr(eager, "unused")  # a submodule nothing imports
    assert not hasattr(lazy, "__all__") and plan.complete  # __all__ resolves everything, then is absent
    assert _view(lazy) == _view(eager)
    star_eager, star_lazy = {}, {}
    exec("from eagerpkg import *", star_eager)
    exec("from lazypkg import *", star_lazy)
    assert sorted(star_lazy) == sorted(star_eager)


def test_dir_before_access_and_later_bindings(synthetic):
    root = synthetic("lazypkg2")
    lazy = _import_lazy(root, "lazypkg2")
    before = dir(lazy)
    assert {"A", "B", "S1", "S2", "shared", "shared2", "sub", "sub2", "a", "b", "c"} <= set(before)
    assert lazy.shared == "assigned later" and lazy.shared2 == "from c"  # the later statement wins
    assert lazy.sub2.Y == 1 and lazy.b.B is lazy.B


_SIDE_EFFECT_FILES = {
    "__init__.py": """
        from .a import A
        from .starpkg import *
        from .late import L
        """,
    "a.py": '''
        from typing import TYPE_CHECKING
        from . import helper  # binds helper in the package, as a side effect
        from .deep.inner import X  # binds deep
        import sidepkg.deep.other  # an absolute import of the package's own module
        if TYPE_CHECKING:
            from . import typed_only
        def function():
            from . import in_function
        async def coroutine(
            argument,
        ):
            from . import in_coroutine
        try:
            from . import in_try
        except ImportError:
            from . import in_except
        if False:
            from . import in_false
        elif 1 + 1 == 3:
            from . import in_elif
        else:
            from . import in_else
        class C:
            from . import in_class
            def method(self):
                from . import in_method
        if __name__ == "__main__":
            from . import in_main
        def documented():
            """
            from . import in_docstring
            """
        A = 1
        ''',
    "deep/__init__.py": "",
    "deep/inner.py": "X = 1\n",
    "deep/other.py": "",
    "starpkg/__init__.py": "from .mod import *\n",  # no __all__: the star exports the submodule too
    "starpkg/mod.py": "__all__ = ['M']\nM = 1\n",
    "starpkg/unused.py": "",
    "late.py": "L = 1\nfrom .starpkg import unused  # after the star import: not exported by it\n",
    **{
        f"{name}.py": ""
        for name in (
            "helper",
            "typed_only",
            "in_function",
            "in_coroutine",
            "in_try",
            "in_except",
            "in_false",
            "in_elif",
            "in_else",
            "in_class",
            "in_method",
            "in_main",
            "in_docstring",
            "never",
        )
    },
}


def test_dir_before_access_lists_what_the_eager_import_binds_as_a_side_effect(synthetic):
    """Submodules bound because some module the eager import runs imports
    them (statements that do not run at import aside), and submodules a star
    import exports: dir() lists them before any access, without importing."""
    root = synthetic("sidepkg_eager", {k: v.replace("sidepkg", "sidepkg_eager") for k, v in _SIDE_EFFECT_FILES.items()})
    synthetic("sidepkg", _SIDE_EFFECT_FILES)
    eager = importlib.import_module("sidepkg_eager")
    lazy = _import_lazy(root, "sidepkg")
    assert "sidepkg.a" not in sys.modules and "helper" not in vars(lazy)
    before = dir(lazy)
    assert not eager_import_scan._eager_bound_errors
    assert before == dir(eager), (sorted(set(dir(eager)) - set(before)), sorted(set(before) - set(dir(eager))))
    assert {"helper", "deep", "in_try", "in_else", "in_class", "mod"} <= set(before)
    assert not {
        "typed_only",
        "in_function",
        "in_coroutine",
        "in_except",
        "in_false",
        "in_elif",
        "in_method",
        "in_main",
        "in_docstring",
        "never",
        "unused",
    } & set(before)
    assert "sidepkg.a" not in sys.modules and "sidepkg.helper" not in sys.modules  # predicted, not imported
    assert lazy.helper is sys.modules["sidepkg.helper"] and lazy.mod is sys.modules["sidepkg.starpkg.mod"]
    assert dir(lazy) == dir(eager) and _view(lazy) == _view(eager)


@pytest.mark.parametrize(
    "files,reason",
    [
        ({"__init__.py": "from __future__ import annotations\nfrom .a import A\n", "a.py": "A = 1\n"}, "__future__"),
        ({"__init__.py": "from . import missing\n"}, "no such submodule"),
        ({"__init__.py": "from .m import *\n", "m.py": "__all__ = ['a'] + ['b']\na = b = 1\n"}, "literal"),
        ({"__init__.py": "from .gone import X\n"}, "not found"),
        (
            {"__init__.py": "from .a import thing as b\nfrom . import b as bb\n", "a.py": "thing = 1\n", "b.py": ""},
            "names both a submodule",
        ),
    ],
)
def test_what_the_parser_does_not_understand_is_imported_eagerly(synthetic, files, reason):
    name = f"brokenpkg_{abs(hash(reason)) % 10000}"
    root = synthetic(name, files)
    try:
        module = _import_lazy(root, name)
    except ImportError:
        module = None  # the eager import fails as it would without the plugin
    row = lazy_import._packages[name]
    assert row.state == "eager" and reason in row.reason, row
    if module is not None:
        assert type(module) is types.ModuleType


# --- the audit: which modules write another module's registry when imported


def _registry_writers(package_dir):
    """Modules of mindone.transformers that, at import, call a method of or
    assign into an object imported from elsewhere (outside `__main__` blocks;
    print, logging and warnings aside)."""
    import ast

    benign_calls = {"print", "logger", "logging", "warnings", "add_start_docstrings"}
    found = {}
    for directory, _, files in os.walk(package_dir):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(directory, file)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            imported = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    imported.update((a.asname or a.name).split(".")[0] for a in node.names)

            def statements(body):
                for node in body:
                    if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                        continue
                    if isinstance(node, (ast.If, ast.Try, ast.With)):
                        for block in ("body", "orelse", "finalbody"):
                            yield from statements(getattr(node, block, []))
                        for handler in getattr(node, "handlers", []):
                            yield from statements(handler.body)
                    else:
                        yield node

            def root_name(expr):
                while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
                    expr = expr.func if isinstance(expr, ast.Call) else expr.value
                return expr.id if isinstance(expr, ast.Name) else None

            for node in statements(tree.body):
                hits = []
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                    hits.append(node.value.func)
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    hits.extend(
                        t
                        for t in getattr(node, "targets", [getattr(node, "target", None)])
                        if isinstance(t, (ast.Attribute, ast.Subscript))
                    )
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    hits.extend(
                        d.func
                        for d in node.decorator_list
                        if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "register"
                    )
                for hit in hits:
                    name = root_name(hit)
                    if name in imported and name not in benign_calls:
                        module = os.path.relpath(path, os.path.dirname(package_dir))[:-3].replace(os.sep, ".")
                        found.setdefault("mindone." + module, set()).add(ast.unparse(hit))
    return found


def test_side_effect_audit_matches_the_installed_mindone():
    spec = importlib.util.find_spec("mindone")
    if spec is None or versions.installed_version("mindone") not in versions.LAZY_IMPORT_MINDONE:
        pytest.skip("mindone of the lazy-import range not installed")
    package_dir = os.path.join(os.path.dirname(spec.origin), "transformers")
    found = _registry_writers(package_dir)
    listed = {m for writers in versions.LAZY_IMPORT_SIDE_EFFECTS.values() for m in writers}
    assert set(found) == listed, json.dumps({k: sorted(v) for k, v in found.items()}, indent=1)


def test_this_suite_runs_with_lazy_import():
    """conftest imports ms_loadpatch before any test module imports mindone."""
    from ms_loadpatch import activation

    if activation.switched_off() or lazy_import.switched_off() or not versions.check().ok:
        pytest.skip("the plugin or its lazy import is off in this session")
    import mindone.transformers as mt
    import mindone.transformers.models as models

    assert type(mt) is lazy_import.LazyPackage and type(models) is lazy_import.LazyPackage
