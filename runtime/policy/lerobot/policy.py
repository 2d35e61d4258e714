"""``--policy lerobot``: a LeRobot pretrained directory served through the ``Policy`` contract.

``prepare`` checks LeRobot's wire keys and runs the checkpoint's own saved
preprocessor (normalization, tokenizer) on the CPU of rank 0, one request at a
time, as LeRobot runs it per frame; ``condition``/``denoise_step`` are the
family's split (families.py); ``postprocess_batch`` runs the saved
postprocessor (unnormalization) over the batch; a checkpoint trained on actions
relative to the state gets each row's own request's state back
(relative_actions.py), never LeRobot's cache of the last one prepared.  With the same weights, a
request of seed ``s`` answers what LeRobot's ``predict_action_chunk(batch,
noise=randn(noise_shape, Generator().manual_seed(s)))`` followed by the
postprocessor answers.  None of these families was trained with an
unconditional branch (``has_unconditional`` False): guidance stays 1.0.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from policy_operator.builtin_policies import BUILTIN_POLICIES, LEROBOT
from policy_operator.runtime.policy.interface import Branch, Context, Integrator, Policy, Sample, context_map
from policy_operator.runtime.policy.lerobot.families import Family, family_of
from policy_operator.runtime.policy.lerobot.loading import Loaded, import_lerobot, load_pretrained
from policy_operator.runtime.policy.lerobot.relative_actions import STATE_KEY, RelativeActions
from policy_operator.runtime.policy.lerobot.staging import DeviceStaging, TokenCache
from policy_operator.runtime.policy.lerobot.wire import ObservationSpec

STAGES = ("prefix", "denoise", "postprocess")  # stage_seconds' names, in order


class LeRobotPolicy(Policy):
    has_unconditional = BUILTIN_POLICIES[LEROBOT].has_unconditional
    pin_memory = False  # per-request pinning cost 7-9 ms of host time on the H200: see ReferencePolicy
    #: cameras converted and normalized on the device for the whole batch (staging.py); False: LeRobot's CPU path
    device_preprocessing = True
    #: ``compile`` compiles the prefix (vision tower, VLM: ``Family.condition``) per batch bucket too, for the
    #: families whose ``compile_prefix`` says so
    compile_prefix = True
    #: ``load`` builds the modules on the serving GPU (under its device context), never on the host first
    build_on_device = True

    def __init__(self, loaded: Loaded, device: torch.device, dtype: torch.dtype) -> None:
        self.loaded = loaded
        self.family: Family = family_of(loaded.policy)
        self.family.attach(loaded.root)
        self.has_unconditional = self.family.has_unconditional  # the family's, not the built-in's default
        self.default_guidance = self.family.default_guidance
        self._device = device
        self.dtype = dtype
        if dtype != torch.float32:
            self.family.cast(dtype)
            if device.type == "cuda":
                # what stays float32 in a reduced-precision model (projections LeRobot keeps float32) multiplies
                # on the tensor cores as TF32, within the bfloat16 bound: pi0.5's float32 SigLIP tower (LeRobot's
                # own mode, Pi0.float32_vision) took 135 ms of matrix products at batch 8 on an H100 in full
                # float32, 49 ms as TF32 (bench/results/lerobot-h100-round2.md)
                torch.backends.cuda.matmul.allow_tf32 = True
        self.name = f"lerobot/{loaded.type}"
        self.history = self.family.history
        self.default_steps = self.family.default_steps
        self.spec = ObservationSpec(loaded.config.input_features, needs_task=self.family.needs_task)
        self._denoise: Callable[[Context, torch.Tensor, torch.Tensor], torch.Tensor] = self.family.denoise
        self._prefix: Callable[[dict[str, torch.Tensor]], Context] = self.family.condition
        staged = self.device_preprocessing and self.family.device_preprocessing
        self._staging = DeviceStaging.of(self.spec, loaded.preprocessor) if staged else None
        self._tokens = TokenCache.install(loaded.preprocessor)
        self._marks: list[torch.cuda.Event | float] = []  # the running batch's stage boundaries (stage_seconds)
        self._integrator = functools.lru_cache(maxsize=8)(self.family.integrator)
        self._relative = RelativeActions.of(loaded.preprocessor, loaded.postprocessor)
        self._normalizers, self.rtc_unsupported_reason = self._rtc_back()

    def _rtc_back(self) -> tuple[list[Any], str | None]:
        """The postprocessor's unnormalizers (private copies: the ingress maps actions back while the output rank
        postprocesses), or why the returned actions cannot be mapped back to the model's space."""
        reason = self.family.rtc_unsupported()
        if reason is not None:
            return [], f"policy {self.name}: {reason}"
        from lerobot.processor import DeviceProcessorStep, UnnormalizerProcessorStep

        normalizers = []
        for step in self.loaded.postprocessor.steps:
            if isinstance(step, UnnormalizerProcessorStep):
                normalizers.append(copy.deepcopy(step))
            elif isinstance(step, DeviceProcessorStep) or not getattr(step, "enabled", True):
                continue
            else:  # e.g. pi0's AbsoluteActionsProcessorStep: its map back depends on the request's state
                return [], (
                    f"policy {self.name}: its postprocessor step {type(step).__name__} cannot be inverted without "
                    "the request's observation, so actions cannot be mapped back to the model's space"
                )
        return normalizers, None

    @classmethod
    def import_dependencies(cls) -> None:
        import_lerobot()

    @classmethod
    def load(
        cls,
        checkpoint: str,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
    ) -> LeRobotPolicy:
        # Built where it serves: LeRobot initialises the policy's modules (random weights, replaced by the
        # checkpoint's) where torch's default device says, and reads model.safetensors straight onto the
        # config's device, so nothing of the model passes through host memory
        with torch.device(device) if device.type == "cuda" and cls.build_on_device else contextlib.nullcontext():
            loaded = load_pretrained(checkpoint, device, trust_remote_code=trust_remote_code)
        return cls(loaded, device, dtype)

    @property
    def action_shape(self) -> tuple[int, int]:
        return (self.family.chunk, self.family.action_dim)

    @property
    def device(self) -> torch.device:
        return self._device

    def integrator(self, steps: int | None = None) -> Integrator:
        return self._integrator(self.default_steps if steps is None else steps)

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta.update(
            {
                "lerobot_type": self.loaded.type,
                "observation_keys": self.spec.describe(),
                "chunk_shape": list(self.action_shape),
                "n_obs_steps": self.history,
            }
        )
        return meta

    def example_observation(self, seed: int = 0) -> dict[str, Any]:
        return self.spec.example(seed)

    # --- serving split ----------------------------------------------------------
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        frame = self.spec.parse(obs, raw_images=self._staging is not None)
        images = self._staging.take(frame) if self._staging is not None else {}
        with torch.inference_mode():
            if self._relative is None:
                batch = self.loaded.preprocessor(frame)
            else:
                batch, state = self._relative.preprocess(self.loaded.preprocessor, frame)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        tensors.update(images)
        tensors.update(self.family.sample_tensors(batch))
        if self._relative is not None:
            tensors[STATE_KEY] = state
        return Sample(tensors)

    def condition(self, sample: Sample, branch: Branch) -> Context:
        if branch is Branch.UNCOND and not self.has_unconditional:
            raise ValueError(f"{self.name} has no unconditional branch")
        pin = self.pin_memory and self._device.type == "cuda"
        batch = {
            k: (v.pin_memory() if pin else v).to(self._device, non_blocking=True)
            for k, v in sample.tensors.items()
            if k != STATE_KEY
        }
        with torch.inference_mode():
            if branch is Branch.COND:
                self._marks = [self._mark()]
            if self._staging is not None:
                batch = self._staging.finish(batch)
            if branch is not Branch.COND:
                return self.family.unconditional(batch)
            context = self._prefix(batch)
            self._marks.append(self._mark())
            return context

    def _mark(self) -> torch.cuda.Event | float:
        """A point in the batch's device work (stage_seconds): a CUDA event on a GPU, read once the batch's
        answer is on the host (no sync of its own), else the host clock."""
        if self._device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stage_seconds(self) -> dict[str, float]:
        """The last batch's prefix (cameras staged + vision tower + VLM prefix, or the family's conditioning),
        denoise (the step loop) and postprocess (unnormalize + the copy to the host)."""
        marks = self._marks
        if len(marks) != 4:
            return {}

        def seconds(a: torch.cuda.Event | float, b: torch.cuda.Event | float) -> float:
            if isinstance(a, float) and isinstance(b, float):
                return b - a
            assert isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event)
            return float(a.elapsed_time(b)) / 1e3

        return {stage: seconds(marks[i], marks[i + 1]) for i, stage in enumerate(STAGES)}

    def guided_steps(self, steps: int) -> tuple[bool, ...]:
        plan = self.family.guided_steps(steps)
        return super().guided_steps(steps) if plan is None else plan

    def denoise_step(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # guided real-time chunking takes a vector-Jacobian product through this step
            return self._denoise(context, x, t)
        with torch.inference_mode():
            return self._denoise(context, x, t)

    def init_noise(self, seed: int) -> torch.Tensor:
        noise = self.family.draw_noise(torch.Generator().manual_seed(seed))
        return noise.to(self._device, dtype=self.family.noise_dtype or self.dtype)

    def postprocess_batch(self, x: torch.Tensor, sample: Sample | None = None) -> list[np.ndarray]:
        if len(self._marks) == 2:  # the step loop's end
            self._marks.append(self._mark())
        with torch.inference_mode():
            chunk = self.family.finish(x).float()  # the saved statistics are float32
            if self._relative is None:
                actions = self.loaded.postprocessor(chunk)
            elif sample is None or STATE_KEY not in sample.tensors:
                raise ValueError(
                    f"{self.name} predicts actions relative to each request's state: postprocess_batch needs the "
                    "batch's prepared sample"
                )
            else:
                actions = self._relative.postprocess(self.loaded.postprocessor, chunk, sample.tensors[STATE_KEY])
        host = actions.float().cpu().numpy()
        if len(self._marks) == 3:
            end = self._mark()
            if isinstance(end, torch.cuda.Event):
                end.synchronize()  # recorded after the copy that already waited: nothing left to wait for
            self._marks.append(end)
        return [host[i] for i in range(host.shape[0])]

    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        return self.postprocess_batch(x)[0]

    def actions_to_model(self, actions: np.ndarray) -> torch.Tensor:
        if self.rtc_unsupported_reason is not None:
            raise NotImplementedError(self.rtc_unsupported_reason)
        chunk = torch.from_numpy(np.asarray(actions, dtype=np.float32))[None]
        with torch.no_grad():
            for step in reversed(self._normalizers):
                chunk = step._normalize_action(chunk, inverse=False)  # noqa: SLF001 - the step's own forward map
            return self.family.unfinish(chunk)[0].float().clone()

    def compile(self, mode: str = "default") -> None:
        # One graph per batch bucket (the replica pads batches to them); the cache is rebuilt inside the graph
        # around the context's tensors.  A CUDA graph's output buffer is reused by its next replay: copy it out.
        compiled: Callable[[Context, torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            self.family.denoise, mode=mode, dynamic=False
        )
        self._denoise = (lambda c, x, t: compiled(c, x, t).clone()) if mode == "reduce-overhead" else compiled
        if self.compile_prefix and self.family.compile_prefix:  # per bucket too; its context outlives the next replay
            prefix: Callable[[dict[str, torch.Tensor]], Context] = torch.compile(
                self.family.condition, mode=mode, dynamic=False
            )
            graphs = mode == "reduce-overhead"
            self._prefix = (lambda b: context_map(torch.clone, prefix(b))) if graphs else prefix
