"""Only swarm.hivemind_private reaches into hivemind's private API. Every other module of swarm/ and peers/ is
parsed, and each of these fails here with its file and line:

- an import of a private name or module of hivemind (``from hivemind.x import _y``, ``import hivemind.x._y``),
  or a private name read off an imported hivemind module (``serialization._BASE_COMPRESSION_TYPES``);
- in a class derived (by name, through swarm's own classes too) from a hivemind class or from one that
  swarm.hivemind_private exports, a private method or class attribute that overrides one of the hivemind
  base's, unless PRIVATE_ATTRIBUTES lists it;
- ``anything._name`` (or ``getattr(anything, "_name")``) where ``_name`` is a private attribute of a hivemind
  class swarm uses, is not listed in PRIVATE_ATTRIBUTES, and is not an attribute swarm defines itself.

A new need for a private name goes into swarm.hivemind_private, behind a public function, and into its
PRIVATE_ATTRIBUTES, which tests/test_hivemind_private.py checks against the installed hivemind."""

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import hivemind
import pytest
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.hivemind_private import PRIVATE_ATTRIBUTES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peers")
PRIVATE_MODULE = "swarm.hivemind_private"
EXEMPT = ROOT / "swarm" / "hivemind_private.py"
# the hivemind classes whose objects swarm holds: their private attributes are what (c) looks for
HIVEMIND_CLASSES = (hivemind.DHT, DHTNode, DHTProtocol, P2P, hivemind.DecentralizedAverager, Matchmaking,
                    RSAPrivateKey, RSAPublicKey)
ALLOWED = frozenset(attribute.name for attribute in PRIVATE_ATTRIBUTES)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_hivemind(module: str) -> bool:
    return module == "hivemind" or module.startswith("hivemind.")


@lru_cache(maxsize=None)
def private_names_of(cls: type) -> FrozenSet[str]:
    """The private attributes of a class: those on the class (inherited ones too) and those its methods, or the
    methods of its hivemind bases, assign as ``self._x``."""
    names = {name for name in dir(cls) if _is_private(name)}
    for base in cls.__mro__:
        if not _is_hivemind(base.__module__):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return frozenset(names)


def _hivemind_bases(obj: object) -> Tuple[type, ...]:
    return tuple(c for c in obj.__mro__ if _is_hivemind(c.__module__)) if isinstance(obj, type) else ()


def _dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        value = _dotted(node.value)
        return None if value is None else f"{value}.{node.attr}"
    return None


def _import_or_none(name: str) -> Optional[object]:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _module_aliases(tree: ast.Module) -> Dict[str, str]:
    """Local names bound to hivemind modules (or to swarm.hivemind_private) -> the module's name."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_hivemind(alias.name) or alias.name == PRIVATE_MODULE:
                    root = alias.name.split(".")[0]
                    aliases[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and _is_hivemind(node.module) and not node.level:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if inspect.ismodule(getattr(_import_or_none(node.module), alias.name, None)) \
                        or (_is_hivemind(name) and _import_or_none(name) is not None):
                    aliases[alias.asname or alias.name] = name
    return aliases


def _imported_objects(tree: ast.Module) -> Dict[str, object]:
    """Local names bound by ``from hivemind... import X`` or ``from swarm.hivemind_private import X`` -> X."""
    objects = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and (_is_hivemind(node.module) or node.module == PRIVATE_MODULE):
            module = _import_or_none(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    objects[alias.asname or alias.name] = getattr(module, alias.name)
    return objects


def _resolve_dotted(name: str, aliases: Dict[str, str]) -> Optional[object]:
    """The object ``name`` names when it starts with an alias of a hivemind module, else None."""
    root, _, rest = name.partition(".")
    if root not in aliases:
        return None
    obj: object = importlib.import_module(aliases[root])
    for part in rest.split(".") if rest else ():
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


@dataclass
class _Module:
    path: str
    tree: ast.Module
    aliases: Dict[str, str]
    imported: Dict[str, object]


@lru_cache(maxsize=None)
def _parse_module(path: str, source: str) -> _Module:
    tree = ast.parse(source, path)
    return _Module(path, tree, _module_aliases(tree), _imported_objects(tree))


@dataclass
class Project:
    """What the checks need to know of the whole code base: its classes' bases and the private names it defines."""

    modules: List[_Module]
    classes: Dict[str, Tuple[ast.ClassDef, _Module]] = field(default_factory=dict)  # by name
    own_names: Set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, sources: Dict[str, str]) -> "Project":
        project = cls([_parse_module(path, source) for path, source in sources.items()])
        modules = project.modules
        for module in modules:
            for node in ast.walk(module.tree):
                if isinstance(node, ast.ClassDef):
                    project.classes[node.name] = (node, module)
        for module in modules:
            project.own_names |= project._defined_privates(module)
        return project

    def hivemind_bases(self, node: ast.ClassDef, module: _Module,
                       seen: FrozenSet[str] = frozenset()) -> Tuple[type, ...]:
        """The hivemind classes a class derives from, through imported classes and swarm's own (matched by name)."""
        bases: List[type] = []
        for expr in node.bases:
            name = _dotted(expr)
            if name is None:
                continue
            short = name.rpartition(".")[2]
            obj = module.imported.get(name) if "." not in name else _resolve_dotted(name, module.aliases)
            if obj is not None:
                bases.extend(_hivemind_bases(obj))
            elif short in self.classes and short not in seen:
                bases.extend(self.hivemind_bases(*self.classes[short], seen | {node.name}))
        return tuple(dict.fromkeys(bases))

    def _defined_privates(self, module: _Module) -> Set[str]:
        """Private names a module defines: ``def _x``, ``self._x =``, ``cls._x =``, ``_x =`` in a class body;
        not those by which a class overrides its hivemind base's (they are hivemind's, checked by (b))."""
        names: Set[str] = set()

        def visit(node: ast.AST, overrides: FrozenSet[str]) -> None:
            defined: Set[str] = set()
            if isinstance(node, ast.ClassDef):
                bases = self.hivemind_bases(node, module)
                overrides = frozenset(name for name in _class_private_names(node) if _overridden(name, bases))
                defined = {name for name, _ in _class_body_names(node) if _is_private(name)}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                defined = {node.name}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined = {node.attr}
            names.update(defined - overrides)
            for child in ast.iter_child_nodes(node):
                visit(child, overrides)

        visit(module.tree, frozenset())
        return names


def _class_body_names(node: ast.ClassDef) -> List[Tuple[str, int]]:
    """(name, line) of the methods and class attributes a class body defines."""
    found = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((item.name, item.lineno))
        elif isinstance(item, ast.Assign):
            found += [(t.id, item.lineno) for t in item.targets if isinstance(t, ast.Name)]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.append((item.target.id, item.lineno))
    return found


def _class_private_names(node: ast.ClassDef) -> Set[str]:
    """The private names a class defines on itself or on its instances (``self._x =`` in its methods)."""
    names = {name for name, _ in _class_body_names(node) if _is_private(name)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and _is_private(sub.attr) \
                and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)
    return names


def _overridden(name: str, bases: Tuple[type, ...]) -> bool:
    return any(name in private_names_of(base) for base in bases)


@lru_cache(maxsize=None)
def hivemind_private_names() -> FrozenSet[str]:
    return frozenset().union(*(private_names_of(cls) for cls in HIVEMIND_CLASSES))


def _import_offences(module: _Module) -> List[str]:
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_hivemind(alias.name) and any(_is_private(part) for part in alias.name.split(".")):
                    found.append(f"{module.path}:{node.lineno}: imports hivemind's private module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _is_hivemind(node.module) and not node.level:
            if any(_is_private(part) for part in node.module.split(".")):
                found.append(f"{module.path}:{node.lineno}: imports from hivemind's private module {node.module}")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{module.path}:{node.lineno}: imports hivemind's private {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = _dotted(node.value)
            if owner is not None and _is_hivemind(module.aliases.get(owner.partition(".")[0], "")):
                found.append(f"{module.path}:{node.lineno}: uses hivemind's private {owner}.{node.attr}")
    return found


def _override_offences(project: Project, module: _Module) -> List[str]:
    found = []
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = project.hivemind_bases(node, module)
        for name, line in _class_body_names(node):
            if _is_private(name) and name not in ALLOWED and _overridden(name, bases):
                owner = next(base for base in bases if name in private_names_of(base))
                found.append(f"{module.path}:{line}: {node.name}.{name} overrides hivemind's private "
                             f"{owner.__name__}.{name}")
    return found


def _attribute_offences(project: Project, module: _Module) -> List[str]:
    suspects = hivemind_private_names() - ALLOWED - project.own_names
    found = []
    for node in ast.walk(module.tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        if name in suspects:
            owners = [cls.__name__ for cls in HIVEMIND_CLASSES if name in private_names_of(cls)]
            found.append(f"{module.path}:{node.lineno}: uses {name}, private to hivemind's {', '.join(owners)}")
    return found


def offences(project: Project, paths: Optional[Set[str]] = None) -> List[str]:
    """Every use of hivemind's private API in the project's modules (those in ``paths``, or all)."""
    found = []
    for module in project.modules:
        if paths is None or module.path in paths:
            found += _import_offences(module) + _override_offences(project, module) \
                + _attribute_offences(project, module)
    return sorted(set(found))


@lru_cache(maxsize=None)
def _project_sources() -> Tuple[Tuple[str, str], ...]:
    paths = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if p != EXEMPT)
    return tuple((str(p.relative_to(ROOT)), p.read_text()) for p in paths)


def test_no_private_hivemind_api_outside_hivemind_private():
    project = Project.parse(dict(_project_sources()))
    assert offences(project) == [], "\n".join(["private hivemind API outside swarm/hivemind_private.py:",
                                              *offences(project)])


def test_the_checks_see_the_averager_subclasses():
    """The classes that override hivemind's private averager hooks are seen as deriving from it, through
    swarm's own classes: otherwise the override check would pass by seeing nothing."""
    project = Project.parse(dict(_project_sources()))
    for name in ("StateSharingAverager", "StageAverager", "FaultyAverager"):
        assert hivemind.DecentralizedAverager in project.hivemind_bases(*project.classes[name]), name


OFFENDING = {
    "private_import": ("from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES\n",
                       "imports hivemind's private hivemind.compression.serialization._BASE_COMPRESSION_TYPES"),
    "private_module": ("import hivemind.p2p._private_thing\n", "private module hivemind.p2p._private_thing"),
    "private_name_of_a_module": ("from hivemind.compression import serialization\n"
                                 "serialization._BASE_COMPRESSION_TYPES.clear()\n",
                                 "uses hivemind's private serialization._BASE_COMPRESSION_TYPES"),
    "override_of_a_private_averager_hook": ("from swarm.hivemind_private import PrivateAverager\n"
                                            "class Mine(PrivateAverager):\n"
                                            "    async def _load_state_from_peers(self, future, timeout):\n"
                                            "        pass\n",
                                            "Mine._load_state_from_peers overrides hivemind's private "
                                            "DecentralizedAverager._load_state_from_peers"),
    "override_through_a_swarm_class": ("from swarm.server.averaging import StageAverager\n"
                                       "class Mine(StageAverager):\n"
                                       "    def _get_group_bits(self):\n"
                                       "        return ''\n",
                                       "Mine._get_group_bits overrides hivemind's private"),
    "override_of_a_hivemind_class": ("from hivemind import DHT\n"
                                     "class Mine(DHT):\n"
                                     "    _record_validator = None\n",
                                     "Mine._record_validator overrides hivemind's private DHT._record_validator"),
    "private_attribute": ("def peek(node):\n    return node._refresh_stale_cache_entries\n",
                          "uses _refresh_stale_cache_entries, private to hivemind's DHTNode"),
    "private_attribute_set_through_getattr": ("def peek(averager):\n"
                                              "    return getattr(averager, '_averaged_tensors')\n",
                                              "uses _averaged_tensors, private to hivemind's DecentralizedAverager"),
}

ALLOWED_USES = {
    "a_public_function_of_hivemind_private": "from swarm.hivemind_private import daemon_connect\n",
    "a_listed_private_attribute": "def hook(averager):\n    return averager._matchmaking\n",
    "an_attribute_of_its_own": ("class Mine:\n    def __init__(self):\n        self._peer_id = 1\n"
                                "def read(x):\n    return x._peer_id\n"),
    "a_method_of_its_own_named_like_hiveminds": ("class Mine:\n"
                                                  "    def _get_visible_maddrs(self):\n        return []\n"
                                                  "    def addresses(self):\n        return self._get_visible_maddrs()\n"),
}


def _check_snippet(source: str) -> List[str]:
    project = Project.parse({**dict(_project_sources()), "snippet.py": source})
    return offences(project, {"snippet.py"})


@pytest.mark.parametrize("case", OFFENDING, ids=list(OFFENDING))
def test_an_offending_use_is_flagged_with_its_line(case):
    source, message = OFFENDING[case]
    found = _check_snippet(source)
    assert any(message in line and line.startswith("snippet.py:") for line in found), found


@pytest.mark.parametrize("case", ALLOWED_USES, ids=list(ALLOWED_USES))
def test_an_allowed_use_passes(case):
    assert _check_snippet(ALLOWED_USES[case]) == []
