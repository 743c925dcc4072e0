"""``desired``'s model declarations: what an SMGWorker declares, what a pass PUTs or withdraws on one replica given its
``declared_models``, and what the finalizer withdraws; another owner's declaration is never touched."""

from __future__ import annotations

from smg_operator.desired import (
    Declaration,
    declaration_owner,
    desired_declaration,
    owned_declarations,
    plan_declarations,
)

UID = "0000-aaaa"
OWNER = declaration_owner(namespace="ns", name="pool", uid=UID)
OTHER = declaration_owner(namespace="ns", name="decode-pool", uid="1111-bbbb")


def _declared(model: str, *owners: tuple[str, str]) -> dict[str, object]:
    return {"model": model, "declarations": [{"owner": o, "role": r} for o, r in owners]}


def test_an_smgworker_declares_its_model_and_role_as_its_own_owner() -> None:
    want = desired_declaration(namespace="ns", name="pool", uid=UID, spec={"model": "org/m", "role": "prefill"})
    assert want == Declaration(model="org/m", role="prefill", owner="smg-operator:ns/pool@0000-aaaa")
    assert want.body() == {"role": "prefill", "owner": OWNER}
    assert desired_declaration(namespace="ns", name="pool", uid=UID, spec={"role": "regular"}) is None


def test_a_replica_without_the_declaration_gets_it_and_one_with_it_gets_no_call() -> None:
    want = Declaration(model="m", role="regular", owner=OWNER)
    assert plan_declarations(want, [], owner=OWNER) == (want, ())
    assert plan_declarations(want, [_declared("m", (OTHER, "decode"))], owner=OWNER) == (want, ())
    assert plan_declarations(want, [_declared("m", (OWNER, "regular"))], owner=OWNER) == (None, ())
    assert plan_declarations(want, [_declared("m", (OWNER, "decode"))], owner=OWNER) == (want, ())  # role changed


def test_a_model_the_smgworker_no_longer_names_is_withdrawn_but_not_another_owners() -> None:
    want = Declaration(model="new", role="regular", owner=OWNER)
    declared = [_declared("old", (OWNER, "regular"), (OTHER, "decode")), _declared("new", (OWNER, "regular"))]
    assert plan_declarations(want, declared, owner=OWNER) == (None, ("old",))
    assert plan_declarations(None, declared, owner=OWNER) == (None, ("new", "old"))


def test_the_finalizer_withdraws_every_declaration_of_its_uid_only() -> None:
    declared = [_declared("a", (OWNER, "regular"), (OTHER, "decode")), _declared("b", ("user", "regular"))]
    assert owned_declarations(declared, owner_uid=UID) == [("a", OWNER)]
    assert owned_declarations([{"model": 5, "declarations": [{"owner": OWNER}]}], owner_uid=UID) == []
