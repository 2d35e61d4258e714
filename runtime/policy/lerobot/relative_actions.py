"""Actions relative to the state (pi0 / pi0.5 trained with ``use_relative_actions``), made absolute per request.

LeRobot's ``RelativeActionsProcessorStep`` keeps the last state its
preprocessor saw, and the paired ``AbsoluteActionsProcessorStep`` adds that
one state back to whatever it postprocesses: right for one robot calling
``select_action`` in turn, wrong for a server that prepares requests on
other threads, ahead of their batch, and postprocesses many robots' rows at
once.  So each request's state is taken from its own pass through the
preprocessor (at the relative step, as that step sees it), travels in its
``Sample`` as a tensor (it collates, and is padded to a bucket, with its
row), and the absolute step is replaced by LeRobot's own
``to_absolute_actions`` with each row's state and the step's own mask.  The
step's shared cache is still written by LeRobot but never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from policy_operator.runtime.errors import InvalidObservation

#: The ``Sample`` tensor holding each row's state as the relative step saw it ([rows, state_dim]); not a model input.
STATE_KEY = "policy_operator.relative_actions.state"

Transition = dict[Any, Any]  # LeRobot's EnvTransition


def run_pipeline(pipeline: Any, data: Any, at: Any, instead: Callable[[Transition], Transition]) -> Any:
    """``pipeline(data)`` (a LeRobot ``DataProcessorPipeline``, hooks included) with ``instead`` run in place of
    its step ``at``."""
    transition = pipeline.to_transition(data)
    for idx, step in enumerate(pipeline.steps):
        for hook in pipeline.before_step_hooks:
            hook(idx, transition)
        transition = instead(transition) if step is at else step(transition)
        for hook in pipeline.after_step_hooks:
            hook(idx, transition)
    return pipeline.to_output(transition)


@dataclass(frozen=True)
class RelativeActions:
    """The preprocessor's relative step (where each request's state is read) and the postprocessor's absolute
    step (replaced by the per-row conversion) of one checkpoint."""

    relative: Any  # RelativeActionsProcessorStep of the preprocessor
    absolute: Any  # AbsoluteActionsProcessorStep of the postprocessor, enabled

    @classmethod
    def of(cls, preprocessor: Any, postprocessor: Any) -> RelativeActions | None:
        """The pair when the postprocessor adds the state back (an enabled absolute step), else None."""
        from lerobot.processor import AbsoluteActionsProcessorStep, RelativeActionsProcessorStep

        absolute = next(
            (s for s in postprocessor.steps if isinstance(s, AbsoluteActionsProcessorStep) and s.enabled), None
        )
        if absolute is None:
            return None
        relative = next((s for s in preprocessor.steps if isinstance(s, RelativeActionsProcessorStep)), None)
        if relative is None or absolute.relative_step is None:
            raise ValueError(
                "the postprocessor adds the state back to the actions (AbsoluteActionsProcessorStep) but the "
                "preprocessor has no RelativeActionsProcessorStep to take it from"
            )
        return cls(relative, absolute)

    def preprocess(self, preprocessor: Any, frame: Any) -> tuple[dict[str, Any], torch.Tensor]:
        """``preprocessor(frame)`` and the state the relative step saw in this very pass ([1, state_dim])."""
        from lerobot.lerobot_types import TransitionKey
        from lerobot.utils.constants import OBS_STATE

        seen: list[torch.Tensor] = []

        def read_state(transition: Transition) -> Transition:
            state = (transition.get(TransitionKey.OBSERVATION) or {}).get(OBS_STATE)
            if not isinstance(state, torch.Tensor):
                raise InvalidObservation(f"this policy predicts actions relative to {OBS_STATE!r}, which is missing")
            seen.append(state.detach().clone())
            return self.relative(transition)

        batch = run_pipeline(preprocessor, frame, self.relative, read_state)
        return batch, seen[0]

    def postprocess(self, postprocessor: Any, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``postprocessor(actions)`` with row ``i`` made absolute with ``states[i]`` (``states`` may have more
        rows, a bucket's padding: they are ignored)."""
        from lerobot.lerobot_types import TransitionKey
        from lerobot.processor import to_absolute_actions

        rows = actions.shape[0]
        if states.shape[0] < rows:
            raise ValueError(f"{states.shape[0]} states for {rows} rows of actions")

        def add_state(transition: Transition) -> Transition:
            action = transition.get(TransitionKey.ACTION)
            if action is None:
                return transition
            mask = self.absolute.relative_step._build_mask(action.shape[-1])  # noqa: SLF001 - the step's own mask
            return {**transition, TransitionKey.ACTION: to_absolute_actions(action, states[:rows], mask)}

        return run_pipeline(postprocessor, actions, self.absolute, add_state)
