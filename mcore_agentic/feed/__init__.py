"""The feed: the rollout side of a step, up to the moment a DP replica holds its rows.

The trainer sees only this surface: :class:`Feed` (``roll_out`` inside the weight sync, ``hand_off`` after it,
``give_back`` after the experience, validation, failure reports, checkpoint parts), the typed hand-off
:class:`StepRows` / :class:`ReplicaRows` (:mod:`.hand_off`), the settings it is built from (:mod:`.settings`), its
construction (:mod:`.build`: :func:`build_feed` from explicit arguments) and its part of the pre-flight
(:mod:`.checks`). Everything else here is the feed's own: the schedules over a trajectory source (:mod:`.rounds` the
one round loop, :mod:`.fresh_rounds`, :mod:`.partial_rounds`, the filter :mod:`.dynamic_sampling`), scoring and the
rollout statistics (:mod:`.scoring`), the leader -> replica exchange (:mod:`.distribute`, the only owner of those
collectives), the table of the fields it carries (:mod:`.fields`: a run's :func:`wanted_fields`), the trajectory dumps
(:mod:`.rollout_dump`) and the rollout engine of a group's leader (:mod:`.engine`). Under separate placement the
trainer's rank 0 reaches the rollout ranks (:mod:`.streamed`, over :mod:`.wire`) and each engine's rank runs a
:class:`RolloutService` (:mod:`.rollout_service`).
"""

from mcore_agentic.feed.build import build_feed
from mcore_agentic.feed.checks import check_agent, check_plugins, check_reward_fn
from mcore_agentic.feed.engine import build_rollout_engine
from mcore_agentic.feed.feed import Feed, Roller, Validation
from mcore_agentic.feed.fields import FILLER_VERSION, wanted_fields
from mcore_agentic.feed.hand_off import ReplicaRows, StepRows
from mcore_agentic.feed.rollout_service import RolloutService
from mcore_agentic.feed.rounds import Rollout
from mcore_agentic.feed.settings import DumpSettings, FeedSettings

__all__ = [
    "FILLER_VERSION", "DumpSettings", "Feed", "FeedSettings", "ReplicaRows", "Roller", "Rollout", "RolloutService",
    "StepRows", "Validation",
    "build_feed", "build_rollout_engine", "check_agent", "check_plugins", "check_reward_fn", "wanted_fields",
]
