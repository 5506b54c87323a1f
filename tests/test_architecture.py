"""The server's domain packages import each other in one direction only.

Every module of ``server/`` is parsed (nothing is imported). An import of ``server.<domain>``
in a domain's module, at module level or inside a function, is an arrow between two domains;
so is an import of a plumbing module (anything of ``server/`` outside the domains: errors,
auth, retention, ...) that imports a domain itself, directly or through more plumbing. The
arrows must form no cycle.
"""

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "server"
DOMAINS = (
    "datasets",
    "runs",
    "contributors",
    "checkpoints",
    "rounds",
    "lifecycle",
    "contributions",
    "downloads",
    "web",
    "accounts",
    "audits",
    "webhooks",
)


def imported_modules(tree: ast.AST) -> set[str]:
    """Every absolute module an import anywhere in the tree names (functions included);
    ``from a import b`` names ``a`` and ``a.b`` (``b`` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def server_modules() -> dict[str, set[str]]:
    """Every module of server/ (dotted name) -> the server modules it imports."""
    modules = {}
    for path in sorted(SERVER.rglob("*.py")):
        parts = path.relative_to(SERVER.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = imported_modules(ast.parse(path.read_text(), str(path)))
    return {
        name: {m for m in imports if m in modules and m != name}
        for name, imports in modules.items()
    }


def domain_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in DOMAINS else None


def domain_graph() -> dict[str, set[str]]:
    """domain -> the other domains its modules import, directly or through plumbing."""
    modules = server_modules()
    graph: dict[str, set[str]] = {domain: set() for domain in DOMAINS}
    for name, imports in modules.items():
        source = domain_of(name)
        if source is None:
            continue
        seen: set[str] = set()
        todo = list(imports)
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            target = domain_of(module)
            if target is None:  # plumbing: follow what it imports
                todo.extend(modules[module])
            elif target != source:
                graph[source].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            cycle = visit(target, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_layering() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_domain_is_a_package_of_the_server() -> None:
    assert [d for d in DOMAINS if not (SERVER / d / "__init__.py").is_file()] == []


def test_the_imports_between_the_server_domains_form_no_cycle() -> None:
    graph = domain_graph()
    cycle = find_cycle(graph)
    arrows = {domain: sorted(targets) for domain, targets in graph.items()}
    assert cycle is None, f"import cycle between domains: {' -> '.join(cycle)}; arrows: {arrows}"
