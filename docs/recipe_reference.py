"""Build docs/recipe-reference.md from the recipe's JSON Schema (`hf_rebasin.recipe.recipe_json_schema`).

    python docs/recipe_reference.py           # (re)write docs/recipe-reference.md
    python docs/recipe_reference.py --check   # exit 1, with a diff summary, when the file is stale

The page is derived from the schema alone: no key, section or strategy name is written here. The
walk follows ``$ref`` (JSON pointers into the schema), ``anyOf`` / ``oneOf`` (with or without a
``discriminator``) and ``allOf`` wherever they appear, the top level included: a schema whose root
is a union (one model per ``job``, say) gives one section per variant. Every object schema reached
(``properties``) gets a section of its own, in the order the walk first meets it, with one row per
key: type, default and description. The output depends only on the schema, so it is deterministic.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Schema = Mapping[str, Any]

HERE = Path(__file__).resolve().parent
PAGE = HERE / "recipe-reference.md"
COMMAND = "python docs/recipe_reference.py"
UNIONS = ("oneOf", "anyOf")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except `-` and `_`, spaces → `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _cell(text: str) -> str:
    """``text`` on one line, safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: Any) -> str:
    """``value`` as inline code (JSON, so that strings, numbers, null and lists read as in YAML)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


@dataclass
class Section:
    """One object schema of the page: its heading, where it is used, and how it was selected."""

    key: str  # identity: the JSON pointer of the schema (or a synthetic one for inline objects)
    schema: Schema
    heading: str
    used_at: list[str] = field(default_factory=list)
    selected_by: list[str] = field(default_factory=list)  # "`name: head-perm` at `strategy`"
    discriminator: str | None = None

    @property
    def anchor(self) -> str:
        return _slug(self.heading)


class Reference:
    """The walk over one schema, and the markdown it renders."""

    def __init__(self, root: Schema) -> None:
        self.root = root
        self.sections: dict[str, Section] = {}
        self.order: list[str] = []
        self.headings: set[str] = set()

    # -- schema navigation ---------------------------------------------------------------------

    def resolve(self, node: Schema) -> tuple[Schema, str | None]:
        """``node`` with its ``$ref`` chain followed; the pointer of the last target (None if inline)."""
        pointer = None
        seen: set[str] = set()
        while isinstance(node, Mapping):
            wrapped = node.get("allOf")
            if isinstance(node.get("$ref"), str):
                if node["$ref"] in seen:
                    break
                pointer = node["$ref"]
                seen.add(pointer)
                node = self._pointer(pointer)
            elif isinstance(wrapped, list) and len(wrapped) == 1 and "properties" not in node:
                node = wrapped[0]  # `allOf: [{$ref}]`: a reference with a description beside it
            else:
                break
        return node, pointer

    def _pointer(self, ref: str) -> Schema:
        if not ref.startswith("#"):
            raise ValueError(f"only local references are supported, not {ref!r}")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    def properties(self, node: Schema) -> tuple[dict[str, Schema], set[str]]:
        """The keys of an object schema and the required ones, ``allOf`` parts merged in order."""
        node, _ = self.resolve(node)
        props: dict[str, Schema] = {}
        required: set[str] = set()
        for part in node.get("allOf", []):
            more, req = self.properties(part)
            props.update(more)
            required |= req
        props.update(node.get("properties", {}))
        required |= set(node.get("required", []))
        return props, required

    def is_object(self, node: Schema) -> bool:
        node, _ = self.resolve(node)
        return "properties" in node or any(self.is_object(p) for p in node.get("allOf", []))

    def branches(self, node: Schema) -> tuple[str, list[Schema]] | None:
        """(``oneOf`` / ``anyOf``, its branches) of a union schema, else None."""
        for kind in UNIONS:
            if isinstance(node.get(kind), list):
                return kind, list(node[kind])
        return None

    def variant_labels(self, node: Schema) -> dict[int, str]:
        """Branch index → discriminator value, for a union with a ``discriminator``."""
        disc = node.get("discriminator")
        found = self.branches(node)
        if not isinstance(disc, Mapping) or found is None:
            return {}
        prop = disc.get("propertyName")
        by_ref = {ref: value for value, ref in (disc.get("mapping") or {}).items()}
        labels: dict[int, str] = {}
        for i, branch in enumerate(found[1]):
            target, pointer = self.resolve(branch)
            value = by_ref.get(pointer) if pointer else None
            if value is None and isinstance(prop, str):
                spec = self.properties(target)[0].get(prop, {})
                spec, _ = self.resolve(spec)
                value = spec.get("const", (spec.get("enum") or [None])[0])
            if value is not None:
                labels[i] = str(value)
        return labels

    # -- sections ------------------------------------------------------------------------------

    def section(self, node: Schema, path: str, *, selected: str | None = None, disc: str | None = None) -> Section:
        """The section of object schema ``node`` (created on first sight), noted as used at ``path``."""
        target, pointer = self.resolve(node)
        key = pointer or f"inline:{path}"
        if key not in self.sections:
            title = target.get("title") or (pointer.rsplit("/", 1)[-1] if pointer else path)
            heading = str(title)
            n = 2
            while heading in self.headings:
                heading = f"{title} ({n})"
                n += 1
            self.headings.add(heading)
            self.sections[key] = Section(key, target, heading, discriminator=disc)
            self.order.append(key)
            self.sections[key].used_at.append(path)
            if selected:
                self.sections[key].selected_by.append(selected)
            self._collect(target, path)
            return self.sections[key]
        found = self.sections[key]
        if path not in found.used_at:
            found.used_at.append(path)
        if selected and selected not in found.selected_by:
            found.selected_by.append(selected)
        return found

    def _collect(self, node: Schema, path: str) -> None:
        """Create the sections of every object schema reachable from the keys of ``node``."""
        props, _ = self.properties(node)
        for name, spec in props.items():
            self._visit(spec, f"{path}.{name}" if path else name)

    def _visit(self, node: Schema, path: str) -> None:
        target, _ = self.resolve(node)
        if self.is_object(target):
            self.section(node, path)
            return
        found = self.branches(target)
        if found is not None:
            labels = self.variant_labels(target)
            prop = (target.get("discriminator") or {}).get("propertyName")
            for i, branch in enumerate(found[1]):
                selected = f"{_code(f'{prop}: {labels[i]}')} at {_code(path)}" if i in labels else None
                if selected is not None and self.is_object(branch):
                    self.section(branch, path, selected=selected, disc=prop)
                else:
                    self._visit(branch, path)
        for part in target.get("allOf", []):
            self._visit(part, path)
        items = target.get("items")
        if isinstance(items, Mapping):
            self._visit(items, f"{path}[]")
        extra = target.get("additionalProperties")
        if isinstance(extra, Mapping):
            self._visit(extra, f"{path}.*")

    # -- types ---------------------------------------------------------------------------------

    def type_of(self, node: Schema, *, skip_description: bool = False) -> str:
        """A short reading of ``node``'s type: links to sections, choices, constraints."""
        target, pointer = self.resolve(node)
        key = pointer or None
        if key is not None and key in self.sections:
            section = self.sections[key]
            return f"[{section.heading}](#{section.anchor})"
        found = self.branches(target)
        if found is not None:
            labels = self.variant_labels(target)
            parts = []
            for i, branch in enumerate(found[1]):
                text = self.type_of(branch)
                _, branch_ref = self.resolve(branch)
                if branch_ref is None and branch.get("description") and not skip_description:
                    text += f" ({branch['description']})"
                if i in labels:
                    text = f"{text} for {_code(labels[i])}"
                parts.append(text)
            prop = (target.get("discriminator") or {}).get("propertyName")
            joined = " or ".join(parts)
            return f"by {_code(prop)}: {joined}" if prop else joined
        if "allOf" in target and "properties" not in target:
            return " and ".join(self.type_of(p) for p in target["allOf"])
        if "const" in target:
            return _code(target["const"])
        if "enum" in target:
            return "one of " + ", ".join(_code(v) for v in target["enum"])
        kind = target.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        words = []
        for k in kinds:
            if k == "array":
                items = target.get("items")
                words.append(f"list of {self._grouped(items)}" if isinstance(items, Mapping) else "list")
            elif k == "object":
                extra = target.get("additionalProperties")
                words.append(
                    f"mapping of string to {self._grouped(extra)}" if isinstance(extra, Mapping) else "mapping"
                )
            elif k == "null":
                words.append("null")
            else:
                words.append(str(k))
        text = " or ".join(words) or "any"
        limits = list(self._limits(target))
        return f"{text} ({', '.join(limits)})" if limits else text

    def _grouped(self, node: Schema) -> str:
        """``type_of(node)``, in parentheses when it is a choice (inside "list of", "mapping of")."""
        text = self.type_of(node)
        return f"({text})" if " or " in text else text

    @staticmethod
    def _limits(node: Schema) -> Iterator[str]:
        for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
            if key in node:
                value = node[key]
                yield f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value:,g}"
        for key, words, unit in (
            ("minLength", "at least", "character"),
            ("maxLength", "at most", "character"),
            ("minItems", "at least", "item"),
            ("maxItems", "at most", "item"),
        ):
            if key in node:
                n = node[key]
                yield f"{words} {n} {unit}{'' if n == 1 else 's'}"
        if "pattern" in node:
            yield f"matching {_code(node['pattern'])}"
        if "format" in node:
            yield f"format {node['format']}"

    def _inherited(self, node: Schema, key: str) -> tuple[bool, Any]:
        """``key`` of ``node``, else of its inline union branches (pydantic puts a field's description
        and default inside a branch when the field is a tagged union)."""
        if key in node:
            return True, node[key]
        found = self.branches(node)
        for branch in found[1] if found else []:
            if "$ref" not in branch and self.branches(branch) is not None:
                has, value = self._inherited(branch, key)
                if has:
                    return has, value
        return False, None

    # -- rendering -----------------------------------------------------------------------------

    def rows(self, section: Section) -> list[str]:
        props, required = self.properties(section.schema)
        names = list(props)
        if section.discriminator in props:  # the tag first: it says which variant this is
            names.remove(section.discriminator)
            names.insert(0, section.discriminator)
        lines = ["| key | type | default | description |", "|---|---|---|---|"]
        for name in names:
            spec = props[name]
            has_description, description = self._inherited(spec, "description")
            own = "description" in spec
            kind = self.type_of(spec, skip_description=has_description and not own)
            has_default, default = self._inherited(spec, "default")
            if name in required:
                shown = "required"
            elif has_default:
                shown = _code(default)
            else:
                shown = "—"
            text = str(description) if has_description else ""
            lines.append(f"| {_code(name)} | {_cell(kind)} | {_cell(shown)} | {_cell(text)} |")
        return lines

    def render_section(self, section: Section, level: str) -> list[str]:
        lines = [f"{level} {section.heading}", ""]
        description = section.schema.get("description")
        if description:
            lines += [" ".join(str(description).split()), ""]
        where = []
        if section.selected_by:
            where.append("Selected by " + "; ".join(section.selected_by) + ".")
        places = [p for p in section.used_at if p]
        if places and not section.selected_by:
            where.append("Used at " + ", ".join(_code(p) for p in places) + ".")
        if where:
            lines += [" ".join(where), ""]
        return [*lines, *self.rows(section), ""]

    def render(self) -> str:
        root, _ = self.resolve(self.root)
        title = root.get("title") or "Recipe"
        found = self.branches(root)
        tops: list[str] = []
        if found is not None and not self.is_object(root):  # the recipe is a union: one section per variant
            labels = self.variant_labels(root)
            prop = (root.get("discriminator") or {}).get("propertyName")
            for i, branch in enumerate(found[1]):
                label = labels.get(i)
                selected = f"{_code(f'{prop}: {label}')}" if label is not None and prop else None
                section = self.section(branch, "", selected=selected, disc=prop)
                if label is not None and prop and section.heading != f"{prop}: {label}":
                    self.headings.discard(section.heading)
                    section.heading = self._unique(f"{prop}: {label}")
                tops.append(section.key)
        else:
            key = "#"
            self.sections[key] = Section(key, root, self._unique("Top-level keys"))
            tops.append(key)
            self._collect(root, "")
        lines = [
            "# Recipe reference",
            "",
            f"<!-- Generated by `{COMMAND}` from `hf_rebasin.recipe.recipe_json_schema()`: do not edit by hand. -->",
            "",
            "Every key a recipe file may hold, read from the recipe's JSON Schema (the one "
            "`hf-rebasin schema` prints for editors), so it cannot drift from what `hf-rebasin` "
            "accepts. Each table lists a section's keys with their type, default and description; "
            "sections that are mappings of their own follow the top level, linked from the type "
            "column. For how to write a recipe, with examples, see [Recipes](recipes.md); for the "
            f"project, the [README](../README.md). Regenerate this page with `{COMMAND}`.",
            "",
        ]
        lines += [f"Schema: {_cell(str(title))}.", ""]
        if len(tops) > 1:
            lines += ["Variants:", ""]
            lines += [f"- [{self.sections[k].heading}](#{self.sections[k].anchor})" for k in tops]
            lines += [""]
        others = [k for k in self.order if k not in tops]
        for key in tops:
            lines += self.render_section(self.sections[key], "##")
        if others:
            lines += ["## Sections", ""]
            for key in others:
                lines += self.render_section(self.sections[key], "###")
        unused = self.unreferenced()
        if unused:
            lines += [
                "## Other definitions",
                "",
                "Object schemas the schema defines but none of the keys above refers to.",
                "",
            ]
            for key in unused:
                lines += self.render_section(self.sections[key], "###")
        return "\n".join(lines).rstrip("\n") + "\n"

    def unreferenced(self) -> list[str]:
        """Sections for the object schemas of ``$defs`` (or ``definitions``) the walk never reached
        (and for what they reach in turn), in the schema's order."""
        before = set(self.sections)
        for container in ("$defs", "definitions"):
            for name, definition in (self.root.get(container) or {}).items():
                pointer = f"#/{container}/{name}"
                if pointer not in self.sections and self.is_object(definition):
                    self.section({"$ref": pointer}, "")
        return [k for k in self.order if k not in before]

    def _unique(self, heading: str) -> str:
        text, n = heading, 2
        while text in self.headings:
            text = f"{heading} ({n})"
            n += 1
        self.headings.add(text)
        return text


def render(schema: Schema | None = None) -> str:
    """The reference page for ``schema`` (default: the recipe's schema from hf_rebasin)."""
    if schema is None:
        from hf_rebasin.recipe import recipe_json_schema

        schema = recipe_json_schema()
    return Reference(schema).render()


def stale_summary(current: str, expected: str, limit: int = 40) -> str:
    """A short unified diff from the file as it is to what the schema gives."""
    diff = list(
        difflib.unified_diff(
            current.splitlines(),
            expected.splitlines(),
            "recipe-reference.md (on disk)",
            "(from the schema)",
            lineterm="",
        )
    )
    changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
    shown = diff[:limit] + ([f"... {len(diff) - limit} more diff lines"] if len(diff) > limit else [])
    return "\n".join([f"{changed} lines differ:", *shown])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the schema gives")
    parser.add_argument("--output", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    expected = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current == expected:
            print(f"{args.output.name} is up to date")
            return 0
        print(f"{args.output} is stale: run `{COMMAND}`", file=sys.stderr)
        print(stale_summary(current, expected), file=sys.stderr)
        return 1
    args.output.write_text(expected, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # document this checkout's hf_rebasin, not another installed one
    sys.exit(main())
