"""Models declared to the router with or without workers (``PUT /models/{model}``): what keeps a model scaled to zero
known.  Mutated only by the lifecycle API (``admin``); read by the request path (``proxy.resolve_model``).

A model is known when a registered worker serves it or when someone declared it.  A declaration belongs to an owner
(a person, or the operator for one SMGWorker), so two SMGWorkers of one model (its prefill and decode pools) each
declare it, and the model stays declared until the last of them withdraws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smg_router.workers.worker import ROLES, SpecError

MAX_MODEL_CHARS = 256
"""The longest model name a declaration takes: it becomes a metric label value."""
DEFAULT_OWNER = "user"


def check_model(model: str) -> str:
    """A declarable model name: 1 to MAX_MODEL_CHARS chars, no control character; SpecError naming ``model`` else."""
    if not model or len(model) > MAX_MODEL_CHARS:
        raise SpecError("model", f"must be 1 to {MAX_MODEL_CHARS} characters long")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in model):
        raise SpecError("model", "must not hold control characters")
    return model


@dataclass(frozen=True, slots=True)
class Declaration:
    """One owner's declaration of a model: the role of the workers it will bring (informative)."""

    owner: str
    role: str

    @classmethod
    def from_json(cls, data: object) -> Declaration:
        """The ``PUT /models/{model}`` body (``{}`` or none: role regular, owner user); SpecError naming the field."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError("body", "must be a JSON object")
        unknown = sorted(set(data) - {"role", "owner"})
        if unknown:
            raise SpecError(unknown[0], "unknown field (known: owner, role)")
        role = "regular" if data.get("role") is None else data["role"]
        if role not in ROLES:
            raise SpecError("role", f"must be one of {', '.join(ROLES)}, not {role!r}")
        owner = DEFAULT_OWNER if data.get("owner") in (None, "") else data["owner"]
        if not isinstance(owner, str) or len(owner) > MAX_MODEL_CHARS:
            raise SpecError("owner", f"must be a string of at most {MAX_MODEL_CHARS} characters")
        return cls(owner=owner, role=role)

    def to_json(self) -> dict[str, str]:
        return {"owner": self.owner, "role": self.role}


class Declarations:
    """Model → owner → declaration."""

    __slots__ = ("_by_model", "_models")

    def __init__(self) -> None:
        self._by_model: dict[str, dict[str, Declaration]] = {}
        self._models: frozenset[str] = frozenset()

    def declare(self, model: str, declaration: Declaration) -> bool:
        """Declare (or re-declare with another role); whether the owner had not declared it before."""
        owners = self._by_model.setdefault(model, {})
        created = declaration.owner not in owners
        owners[declaration.owner] = declaration
        self._models = frozenset(self._by_model)
        return created

    def withdraw(self, model: str, owner: str | None = None) -> bool:
        """Withdraw one owner's declaration (None: every one); whether there was one."""
        owners = self._by_model.get(model)
        if owners is None or (owner is not None and owner not in owners):
            return False
        if owner is None:
            owners.clear()
        else:
            del owners[owner]
        if not owners:
            del self._by_model[model]
        self._models = frozenset(self._by_model)
        return True

    def models(self) -> frozenset[str]:
        """Every declared model (a view built once per change: read on every request)."""
        return self._models

    def of(self, model: str) -> list[Declaration]:
        return sorted(self._by_model.get(model, {}).values(), key=lambda d: d.owner)

    def to_json(self, model: str) -> dict[str, Any]:
        return {"model": model, "declarations": [d.to_json() for d in self.of(model)]}

    def all_json(self) -> list[dict[str, Any]]:
        return [self.to_json(m) for m in sorted(self._by_model)]
