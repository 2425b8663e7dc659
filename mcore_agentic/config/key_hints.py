"""The hint for an unknown key of the run's config: what the schema alone says, plus what this project knows.

:func:`suggest_key` is ``RLConfig.unknown_key_hint``, so :func:`mcore_agentic.utils.walk.build` uses it for
the run's tree (and the command line's checks in :mod:`.load` call it directly). In order: a retired key's
replacement; verl's name of a key (:mod:`.verl_lookup`: the alias's native key, or why it is not needed, or what
differs); a close verl key under a group only verl has; the key under a misspelt group; a close name in the same
group; a close verl key; the same distinctive name in another group; the group's keys (a small group) or the
reference doc. The hint is never empty, never a key of another meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore_agentic.config import verl_lookup
from mcore_agentic.utils.walk import close_in_group, elsewhere_hint, missing_group_hint

RETIRED_KEYS: dict[str, str] = {
    "sharding.offload_actor_params": "use actor.param_offload (verl's key, the one switch)",
    "sharding.offload_actor_grads": "use actor.grad_offload (verl's key, the one switch)",
    "sharding.offload_actor_optimizer": "use actor.optimizer_offload (verl's key, the one switch)",
    "sharding.flat_gather": "removed: the per-tensor gather was as fast or faster at every bucket size; drop the key",
}
"""Keys an earlier version accepted, with what to write instead."""


def suggest_key(key: str, path: str, known: Sequence[str], root_leaves: Sequence[str]) -> str:
    """The hint after "unknown key; " for ``key`` under ``path`` (the order is in the module docstring)."""
    full = f"{path}.{key}" if path else key
    if full in RETIRED_KEYS:
        return RETIRED_KEYS[full]
    hint = verl_lookup.hint(full)
    if hint:
        return hint
    if verl_lookup.is_verl_root(full):  # under a group only verl has: a close verl key, or its doc
        return verl_lookup.close_key(full, frozenset(root_leaves)) or f"see {verl_lookup.DOC}"
    return (missing_group_hint(key, path, root_leaves) or close_in_group(key, path, known)
            or verl_lookup.close_key(full, frozenset(root_leaves)) or elsewhere_hint(key, path, known, root_leaves))
