"""``policyserver fetch --references``: the hub repositories a checkpoint names, fetched into the cache and loaded offline.

The checkpoint and the repositories it names are served by the hub stub on
127.0.0.1 to the real huggingface_hub client; the offline load is the real
transformers ``from_pretrained`` in a process with ``HF_HUB_OFFLINE=1`` and
``HF_HUB_CACHE`` at the view the fetch made, so what passes here is what a
server pod does.  The hub's clients read their settings (``HF_ENDPOINT``,
``HF_HOME``) from the environment of a process of their own; fetches from
local sources and ``checkpoint verify`` run their main in this process
(``policyserver_main``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_operator.constants import HUB_VIEW_DIR
from policy_operator.exit_codes import CheckpointExit, FetchExit
from policy_operator.runtime.checkpoint.format import write_manifest
from policy_operator.runtime.checkpoint.prune import prunable
from policy_operator.source_uri import request_key
from tests.support.hub_stub import HubStub
from tests.support.servers import VENV_BIN

CKPT, VLM, TOK = "lab/tiny-vla", "lab/tiny-vlm", "lab/tiny-tokenizer"


def write_checkpoint(root: Path, vlm: str = VLM, tokenizer: str = TOK) -> Path:
    """A LeRobot-shaped directory whose config names a VLM and whose saved preprocessor names a tokenizer."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"type": "smolvla", "vlm_model_name": vlm, "chunk_size": 8}))
    (root / "policy_preprocessor.json").write_text(
        json.dumps(
            {
                "name": "policy_preprocessor",
                "steps": [
                    {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
                    {"registry_name": "tokenizer_processor", "config": {"tokenizer_name": tokenizer, "max_length": 16}},
                ],
            }
        )
    )
    # a saved LeRobot pipeline is both processors (checkpoint verify checks them as serve would load them)
    (root / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": []}))
    (root / "model.safetensors").write_bytes(os.urandom(1 << 16))
    write_manifest(root)
    return root


def write_repos(root: Path) -> tuple[Path, Path]:
    """A model config repository and a tokenizer repository (with its model's config, which AutoTokenizer reads
    first, as on the hub), as transformers saves them; no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    # transformers 5's configs are @strict dataclasses whose generated __init__ mypy does not see
    config = LlamaConfig(  # type: ignore[call-arg]
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128
    )
    config.save_pretrained(root / "vlm")
    config.save_pretrained(root / "tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["pick up the cube", "open the drawer"],
        trainer=trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>"], show_progress=False),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(root / "tokenizer")
    return root / "vlm", root / "tokenizer"


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_repos(tmp_path_factory.mktemp("repos"))


def fetch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "policyserver"), "fetch", *args], env=env, capture_output=True, text=True, timeout=120
    )


def hub_env(cli_env: dict[str, str], hub: HubStub, home: Path) -> dict[str, str]:
    env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    return env


# First with the process's own empty cache (the control: nothing resolves the names), then with the view.
OFFLINE_LOAD = """
import sys
import huggingface_hub.constants as hub
from transformers import AutoConfig, AutoTokenizer
try:
    AutoConfig.from_pretrained(sys.argv[1])
    print("resolved without the view")
except OSError:
    pass
hub.HF_HUB_CACHE = sys.argv[3]
config = AutoConfig.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
print(config.model_type, config.hidden_size, len(tokenizer("pick up the cube")["input_ids"]))
"""


def load_offline(cli_env: dict[str, str], view: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """What a server pod does: transformers resolves the names with no hub (HF_ENDPOINT is a closed port)."""
    env = {k: v for k, v in cli_env.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(home), HF_ENDPOINT="http://127.0.0.1:9")
    return subprocess.run(
        [sys.executable, "-c", OFFLINE_LOAD, VLM, TOK, str(view)], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow  # two fetches, then transformers loads the named repositories in a subprocess
def test_named_repositories_are_fetched_and_load_offline(repos, tmp_path: Path, cli_env) -> None:
    vlm, tokenizer = repos
    ckpt = write_checkpoint(tmp_path / "ckpt")
    dest = tmp_path / "models"
    with HubStub() as hub:
        hub.add_repo(CKPT, ckpt)
        vlm_commit = hub.add_repo(VLM, vlm)
        hub.add_repo(TOK, tokenizer)
        env = hub_env(cli_env, hub, tmp_path / "hf-home")
        first = fetch(env, f"hf://{CKPT}", str(dest), "--references")
        hub.reset_log()
        again = fetch(env, f"hf://{CKPT}", str(dest), "--references")
        again_requests = list(hub.requests)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == str(dest / request_key(f"hf://{CKPT}"))
    assert "config.json vlm_model_name names lab/tiny-vlm" in first.stderr
    assert "policy_preprocessor.json tokenizer_name names lab/tiny-tokenizer" in first.stderr
    assert again.returncode == 0 and again_requests == [], (again.stderr, again_requests)  # all already there
    view = dest / HUB_VIEW_DIR / "models--lab--tiny-vlm"
    assert (view / "refs" / "main").read_text() == vlm_commit
    assert (view / "snapshots" / vlm_commit).resolve() == (dest / request_key(f"hf://{VLM}")).resolve()
    verify = subprocess.run(
        [
            str(VENV_BIN / "policyserver"),
            "checkpoint",
            "verify",
            str(dest / request_key(f"hf://{CKPT}")),
            "--require-marker",
            "--references",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env,
    )
    assert verify.returncode == CheckpointExit.OK, verify.stderr

    loaded = load_offline(cli_env, dest / HUB_VIEW_DIR, tmp_path / "pod-home")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[:2] == ["llama", "32"], loaded.stdout  # and not "resolved without the view"


def test_a_repository_the_hub_does_not_have_fails_the_fetch_naming_who_asked(
    policyserver_main, repos, tmp_path: Path, cli_env
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", vlm="lab/not-there")
    dest = tmp_path / "models"
    with HubStub() as hub:
        hub.add_repo(CKPT, ckpt)
        hub.add_repo(TOK, repos[1])
        res = fetch(hub_env(cli_env, hub, tmp_path / "hf-home"), f"hf://{CKPT}", str(dest), "--references")
    # the hub's 404 (huggingface_hub's RepositoryNotFoundError) is a missing repository, failed at once (exit 6,
    # in the fetch Job's podFailurePolicy), not an unreachable source worth the Job's retries (exit 3)
    assert res.returncode == FetchExit.NOT_FOUND, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "policyserver fetch: error: config.json vlm_model_name names lab/not-there, which the "
        "server needs offline: hf://lab/not-there: not on the hub (RepositoryNotFoundError"
    ), last
    verify = policyserver_main(
        "checkpoint", "verify", str(dest / request_key(f"hf://{CKPT}")), "--require-marker", "--references"
    )
    assert verify.returncode == CheckpointExit.INVALID and "lab/not-there, not fetched" in verify.stderr


def test_a_path_of_another_machine_is_a_usage_error(policyserver_main, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", vlm="/home/trainer/smolvlm")
    res = policyserver_main("fetch", str(ckpt), str(tmp_path / "models"), "--references")
    assert res.returncode == FetchExit.USAGE, res.stderr
    assert "config.json: vlm_model_name names '/home/trainer/smolvlm', which is not a hub repository" in res.stderr


def test_a_bundled_reference_needs_no_fetch(policyserver_main, tmp_path: Path) -> None:
    """A checkpoint that carries what it names (a relative directory inside it) is complete as it is."""
    ckpt = write_checkpoint(tmp_path / "ckpt", vlm="vlm", tokenizer="vlm")
    (ckpt / "vlm").mkdir()
    (ckpt / "vlm" / "config.json").write_text("{}")
    write_manifest(ckpt)
    res = policyserver_main("fetch", str(ckpt), str(tmp_path / "models"), "--references")
    assert res.returncode == 0 and "names" not in res.stderr, res.stderr
    assert not (tmp_path / "models" / HUB_VIEW_DIR).exists()


def test_prune_keeps_what_a_kept_checkpoint_names(repos, tmp_path: Path, cli_env) -> None:
    """A VLM fetched for an old checkpoint and named by the new one stays; one only the removed checkpoint named
    goes; neither counts towards --keep-last."""
    dest = tmp_path / "models"
    with HubStub() as hub:
        hub.add_repo(VLM, repos[0])
        hub.add_repo(TOK, repos[1])
        hub.add_repo("lab/other-vlm", repos[0])
        env = hub_env(cli_env, hub, tmp_path / "hf-home")
        keys = {}
        for name, vlm in (("old", "lab/other-vlm"), ("new", VLM)):
            src = write_checkpoint(tmp_path / name, vlm=vlm)
            res = fetch(env, str(src), str(dest), "--references")
            assert res.returncode == 0, res.stderr
            keys[name] = request_key(str(src))
    removed = {p.name for p in prunable(dest, {keys["new"]}, keep_last=2)}
    assert removed == set()  # keep-last 2: the old checkpoint stays, and with it what it names
    removed = {p.name for p in prunable(dest, {keys["new"]}, keep_last=1)}
    assert removed == {keys["old"], request_key("hf://lab/other-vlm")}


def test_a_checkpoint_without_a_manifest_verifies_against_the_fetch_marker(policyserver_main, tmp_path: Path) -> None:
    """LeRobot checkpoints on the hub carry no manifest.json: the marker (every file the fetch verified) stands in."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (ckpt / "manifest.json").unlink()
    dest = tmp_path / "models"
    assert policyserver_main("fetch", str(ckpt), str(dest)).returncode == 0

    def verify(*flags: str) -> subprocess.CompletedProcess[str]:
        return policyserver_main("checkpoint", "verify", str(dest / request_key(str(ckpt))), *flags)

    marked = verify("--require-marker")
    assert marked.returncode == CheckpointExit.OK and "4 files verified" in marked.stdout, marked.stderr
    assert verify().returncode == CheckpointExit.INVALID  # without the marker nothing vouches for the files
    (dest / request_key(str(ckpt)) / "model.safetensors").write_bytes(b"truncated")
    assert verify("--require-marker").returncode == CheckpointExit.INVALID


def test_a_familys_own_reference_keys_are_fetched(tmp_path: Path) -> None:
    """LingBot-VA names its VAE, text encoder and tokenizer repository in ``wan_pretrained_path``: the fetch finds
    it as it finds a VLM, or the pod could not load the published checkpoint offline."""
    from policy_operator.runtime.checkpoint.references import find_references

    root = tmp_path / "lingbot"
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps({"type": "lingbot_va", "wan_pretrained_path": "robbyant/lingbot-va-base"})
    )
    assert [(r.repo_id, r.key) for r in find_references(root)] == [("robbyant/lingbot-va-base", "wan_pretrained_path")]
    (root / "wan").mkdir()  # bundled, as `checkpoint init --lerobot lingbot_va` writes it: nothing to fetch
    (root / "config.json").write_text(json.dumps({"type": "lingbot_va", "wan_pretrained_path": "wan"}))
    assert find_references(root) == []
