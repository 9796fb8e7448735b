"""Named roles (hf_rebasin.core.roles): a transport's target, base and fine-tune are fields, in the
order of `Recipe.refs`; a merge's reference A comes before B, C, …"""

from __future__ import annotations

from hf_rebasin.core.roles import MergeRoles, TransportRoles, letter
from hf_rebasin.recipe import loads_recipe

TRANSPORT = """
job: transport
base: zoo:gpt2-seed0
finetuned: zoo:gpt2-ft-seed0
target: zoo:gpt2-seed1
strategy: vanilla
alpha: 1.0
calibrate: false
output: {dir: out}
"""

MERGE = """
job: merge
models: [zoo:gpt2-seed0, zoo:gpt2-seed1, zoo:gpt2-seed2]
strategy: weight-matching
output: {dir: out}
"""


def test_a_transport_names_its_models_by_role() -> None:
    recipe = loads_recipe(TRANSPORT)
    roles = recipe.roles()
    assert isinstance(roles, TransportRoles)
    assert roles.target == ("target.model", recipe.target)
    assert roles.base == ("base.model", recipe.base)
    assert roles.finetune == ("finetuned.model", recipe.finetuned)
    assert roles.reference is roles.target  # A is aligned to B
    assert list(roles.all) == recipe.refs  # the order every record keeps
    assert roles.names == ("target", "base", "finetuned")


def test_a_merge_has_a_reference_and_others_lettered_from_a() -> None:
    recipe = loads_recipe(MERGE)
    roles = recipe.roles()
    assert isinstance(roles, MergeRoles)
    assert roles.reference[0] == "models.0.model"
    assert [where for where, _ in roles.others] == ["models.1.model", "models.2.model"]
    assert roles.names == ("A", "B", "C")
    assert roles.map(lambda wr: wr[1].model).all == ("zoo:gpt2-seed0", "zoo:gpt2-seed1", "zoo:gpt2-seed2")


def test_letters_past_z() -> None:
    assert [letter(i) for i in (0, 1, 25, 26)] == ["A", "B", "Z", "#27"]
