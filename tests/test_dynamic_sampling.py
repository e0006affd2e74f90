"""Tests of DAPO dynamic sampling (`rpg_trl.dynamic_sampling`): pure functions on hand-made batches, the sampling loop
with a simulated trainer (one and two processes), and a tiny end-to-end training run (CPU, no hub)."""

import json
import math
import os
import socket
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.config import DynamicSamplingArguments
from rpg_trl.dynamic_sampling import (
    PROMPT_STREAM_FILE,
    DynamicSamplingMixin,
    PromptStream,
    choose_groups,
    concat_batches,
    generate_with_dynamic_sampling,
    groups_to_draw,
    groups_with_signal,
    num_loss_tokens,
    prompt_key,
    select_groups,
)
from rpg_trl.testing import build_char_tokenizer

from helpers.tiny_runs import PROMPTS, sevens_unless_even, tiny_run_args


NAN = float("nan")


# ---------------------------------------------------------------------------------------------------------- pure parts
def test_groups_with_signal_flags_exactly_the_groups_with_unequal_rewards():
    rewards = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # all wrong: no signal
            [1.0, 0.0, 1.0, 1.0],  # signal
            [1.0, 1.0, 1.0, 1.0],  # all right: no signal
            [NAN, 1.0, NAN, NAN],  # one scorable completion: no signal
            [NAN, 0.0, 1.0, NAN],  # two scorable completions that differ: signal
            [0.5, 0.5 + 1e-9, 0.5, 0.5],  # equal up to atol: no signal
            [NAN, NAN, NAN, NAN],  # nothing scorable: no signal
            [-0.25, -0.5, -0.25, -0.25],  # overlong penalties that differ: signal
        ]
    ).flatten()
    assert groups_with_signal(rewards, 4).tolist() == [False, True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="divisible by num_generations=3"):
        groups_with_signal(rewards, 3)


def test_choose_groups_prefers_signal_then_fills_with_zero_variance_groups():
    signals = [torch.tensor([False, True, False, True]), torch.tensor([True, True, False, False])]
    assert choose_groups(signals, 3) == ([[1, 3], [0]], 0)
    assert choose_groups(signals, 4) == ([[1, 3], [0, 1]], 0)
    # Only 4 groups with signal: the 5th and 6th are the earliest zero-variance groups.
    assert choose_groups(signals, 6) == ([[0, 1, 2, 3], [0, 1]], 2)
    assert choose_groups([torch.tensor([False, False])], 2) == ([[0, 1]], 2)
    with pytest.raises(ValueError, match="Only 2 groups"):
        choose_groups([torch.tensor([True, True])], 3)


@pytest.mark.parametrize(
    "missing, kept_fraction, full, expected",
    [(0, 0.5, 8, 0), (3, 0.5, 8, 6), (3, 0.0, 8, 8), (10, 0.5, 8, 8), (1, 1.0, 8, 1), (1, 0.9, 8, 2), (2, 0.7, 8, 3)],
)
def test_groups_to_draw(missing, kept_fraction, full, expected):
    assert groups_to_draw(missing, kept_fraction, full) == expected


def _stream_order(dataset_size, seed, count):
    stream = PromptStream(dataset_size, seed)
    return [stream.next_index() for _ in range(count)]


def test_prompt_stream_reads_shuffled_passes_in_order_and_resumes_from_its_state():
    stream = PromptStream(10, seed=3)
    first_pass, second_pass = [stream.next_index() for _ in range(10)], [stream.next_index() for _ in range(10)]
    assert sorted(first_pass) == sorted(second_pass) == list(range(10))  # every row once per pass
    assert first_pass != list(range(10)) and first_pass != second_pass  # shuffled, a new order each pass
    assert _stream_order(10, 3, 20) == first_pass + second_pass  # seeded
    assert _stream_order(10, 4, 10) != first_pass
    # Taking advances through the stream; a stream rebuilt from the state continues where the first one stopped.
    stream = PromptStream(10, seed=3)
    assert stream.take(4, key=lambda i: i, exclude=set()) == first_pass[:4]
    state = stream.state_dict()
    assert state == {"dataset_size": 10, "seed": 3, "epoch": 0, "position": 4}
    resumed = PromptStream(**state)
    assert resumed.take(6, key=lambda i: i, exclude=set()) == first_pass[4:]
    assert resumed.take(2, key=lambda i: i, exclude=set()) == second_pass[:2]  # the next pass
    with pytest.raises(ValueError, match="non-empty"):
        PromptStream(0, seed=3)


def test_prompt_stream_passes_over_prompts_already_in_the_batch():
    order = _stream_order(10, 3, 20)
    stream = PromptStream(10, seed=3)
    in_batch = {order[0], order[2]}
    assert stream.take(3, key=lambda i: i, exclude=in_batch) == [order[1], order[3], order[4]]
    assert in_batch == {order[0], order[1], order[2], order[3], order[4]} and stream.position == 5
    # The key decides: rows with equal prompts (here i and i + 5) count as the same prompt.
    assert (
        PromptStream(10, seed=3).take(5, key=lambda i: i % 5, exclude=set())
        == [i for n, i in enumerate(order) if i % 5 not in {j % 5 for j in order[:n]}][:5]
    )
    # A dataset too small to avoid repeats: once every row was passed over, the stream's next rows are taken.
    stream = PromptStream(3, seed=3)
    assert stream.take(2, key=lambda i: i, exclude={0, 1, 2}) == _stream_order(3, 3, 8)[6:8]


def test_prompt_key_is_a_fingerprint_of_the_prompt():
    chat = [{"role": "user", "content": "1+1="}]
    assert prompt_key("1+1=") == prompt_key("1+1=") != prompt_key("1+2=")
    assert prompt_key(chat) == prompt_key([{"role": "user", "content": "1+1="}]) != prompt_key("1+1=")
    assert isinstance(prompt_key(chat), int) and -(2**63) <= prompt_key(chat) < 2**63


def _scored_batch(prompt_lens, completion_lens, advantages, pad_id=0, start=1):
    """A hand-made scored batch in TRL's layout: left-padded prompts, right-padded completions."""
    rows = len(prompt_lens)
    width_p, width_c = max(prompt_lens), max(completion_lens)
    prompt_ids = torch.full((rows, width_p), pad_id)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    completion_ids = torch.full((rows, width_c), pad_id)
    completion_mask = torch.zeros(rows, width_c, dtype=torch.long)
    logps = torch.zeros(rows, width_c)
    for i, (lp, lc) in enumerate(zip(prompt_lens, completion_lens)):
        prompt_ids[i, width_p - lp :] = start + i
        prompt_mask[i, width_p - lp :] = 1
        completion_ids[i, :lc] = start + i
        completion_mask[i, :lc] = 1
        logps[i, :lc] = -(start + i)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old_per_token_logps": logps,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "ref_per_token_logps": None,
        "num_items_in_batch": completion_mask.sum(),
    }


def test_select_groups_keeps_whole_groups_and_drops_batch_totals():
    batch = _scored_batch([2, 3, 1, 2, 3, 3], [1, 2, 3, 1, 2, 2], [0.5, -0.5, 0.0, 0.0, 1.0, -1.0])
    batch["tags"] = list("abcdef")
    out = select_groups(batch, [0, 2], num_generations=2)
    assert out["tags"] == ["a", "b", "e", "f"]
    assert out["advantages"].tolist() == [0.5, -0.5, 1.0, -1.0]
    assert torch.equal(out["completion_ids"], batch["completion_ids"][[0, 1, 4, 5]])
    assert "num_items_in_batch" not in out and out["ref_per_token_logps"] is None
    with pytest.raises(IndexError):
        select_groups(batch, [3], num_generations=2)
    with pytest.raises(ValueError, match="text-only"):
        select_groups({**batch, "pixel_values": torch.zeros(5, 3)}, [0], num_generations=2)


def test_concat_batches_pads_prompts_left_and_completions_right():
    a = _scored_batch([2, 1], [1, 2], [1.0, -1.0], pad_id=9, start=1)  # prompt width 2, completion width 2
    b = _scored_batch([3, 3], [4, 1], [0.5, -0.5], pad_id=9, start=5)  # prompt width 3, completion width 4
    a.pop("num_items_in_batch"), b.pop("num_items_in_batch")
    a["tool_mask"], b["tool_mask"] = torch.ones(2, 2, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    out = concat_batches([a, b], pad_token_id=9)
    assert out["prompt_ids"].tolist() == [[9, 1, 1], [9, 9, 2], [5, 5, 5], [6, 6, 6]]
    assert out["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[1, 9, 9, 9], [2, 2, 9, 9], [5, 5, 5, 5], [6, 9, 9, 9]]
    assert out["completion_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert out["old_per_token_logps"].tolist() == [[-1, 0, 0, 0], [-2, -2, 0, 0], [-5] * 4, [-6, 0, 0, 0]]
    assert out["tool_mask"][:2, 2:].tolist() == [[1, 1], [1, 1]]
    assert out["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert out["ref_per_token_logps"] is None
    assert num_loss_tokens(out).item() == 1 + 2 + 4 + 1
    with pytest.raises(ValueError, match="different entries"):
        concat_batches([a, {k: v for k, v in b.items() if k != "tool_mask"}], pad_token_id=9)


# ------------------------------------------------------------------------------------- the loop, simulated processes
class _FakeAccelerator:
    device = torch.device("cpu")

    def __init__(self, num_processes, process_index, first_round):
        self.num_processes, self.process_index, self.first_round = num_processes, process_index, first_round

    def gather(self, tensor):
        if tensor.dim() == 0:  # the token count: every simulated process contributes the same
            return tensor.reshape(1).repeat(self.num_processes)
        # The fingerprints of the data loader's prompts: every process's, in process order.
        return torch.tensor([prompt_key(row["prompt"]) for rows in self.first_round for row in rows[::2]])


def _fake_trainer(num_processes, process_index, max_rounds, first_round, dataset_size=50, num_generations=2):
    args = SimpleNamespace(
        dynamic_sampling=True, dynamic_sampling_max_rounds=max_rounds, dynamic_sampling_metric=None, seed=3
    )
    return SimpleNamespace(
        args=args,
        num_generations=num_generations,
        accelerator=_FakeAccelerator(num_processes, process_index, first_round),
        _metrics={"train": defaultdict(list)},
        prompt_stream=None,
        processing_class=SimpleNamespace(pad_token_id=0),
        train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(dataset_size)]}),
        _remove_unused_columns=lambda dataset, description: dataset,
        data_collator=lambda rows: rows,
        reward_weights=torch.ones(1),
        reward_func_names=["acc"],
    )


def _signal(prompt):
    """Deterministic 'has signal' per prompt: a third of the prompts have all-equal rewards."""
    return int(prompt[1:]) % 3 != 0


def _simulated_generate_round(trainer, all_inputs_of_round):
    """`_generate_and_score_completions` of one simulated process: scores the round's global inputs (all processes'
    rows, in process order) so that the gathered rewards are the same on every process, returns the local rows."""

    def generate_round(local_inputs):
        global_inputs = all_inputs_of_round(local_inputs)
        rewards = []
        for row in global_inputs[:: trainer.num_generations]:
            rewards += [1.0, 0.0] if _signal(row["prompt"]) else [1.0, 1.0]
        n = len(local_inputs)
        batch = _scored_batch([1] * n, [1 + i % 3 for i in range(n)], [0.0] * n)
        batch["prompt"] = [row["prompt"] for row in local_inputs]
        return batch, torch.tensor(rewards).unsqueeze(1)

    return generate_round


def _run_simulated(num_processes, max_rounds, first_round, steps=1):
    """Runs the loop for `steps` generation batches on every simulated process (the same data loader batch each
    time); the global inputs of an extra round are the stream's global draw, which every process computes alike.
    Returns, per process, the batches, the metrics and the global draws of the extra rounds."""
    G, groups_per_process = 2, len(first_round[0]) // 2
    results = []
    take = PromptStream.take
    for p in range(num_processes):
        trainer = _fake_trainer(num_processes, p, max_rounds, first_round)
        draws = []

        def recording_take(stream, *args, draws=draws, **kwargs):
            draws.append(take(stream, *args, **kwargs))
            return draws[-1]

        def all_inputs_of_round(local_inputs, p=p, draws=draws):
            if local_inputs is first_round[p]:
                return [row for rows in first_round for row in rows]
            return [{"prompt": f"p{i}"} for i in draws[-1] for _ in range(G)]

        with patch.object(PromptStream, "take", recording_take):
            batches = [
                generate_with_dynamic_sampling(
                    trainer, _simulated_generate_round(trainer, all_inputs_of_round), first_round[p]
                )
                for _ in range(steps)
            ]
        results.append((batches[0] if steps == 1 else batches, dict(trainer._metrics["train"]), draws))
    assert all(len(batch["prompt"]) == groups_per_process * G for batch, *_ in results if steps == 1)
    return results


def _rows(prompts, G=2):
    return [{"prompt": p} for p in prompts for _ in range(G)]


def _stream_order_without(prompts, count):
    """The first `count` rows of the simulated trainers' stream (50 prompts, seed 3) that are not `prompts`."""
    order = _stream_order(50, 3, 50)
    return [i for i in order if f"p{i}" not in prompts][:count]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_loop_replaces_exactly_the_zero_variance_groups(num_processes):
    # 4 groups per process; p0, p3, p6, p9 have no signal.
    first = [_rows([f"p{i}" for i in range(4 * q, 4 * q + 4)]) for q in range(num_processes)]
    results = _run_simulated(num_processes, max_rounds=20, first_round=first)
    for p, (batch, metrics, _) in enumerate(results):
        prompts = batch["prompt"][::2]
        assert all(_signal(x) for x in prompts), prompts  # every kept group has signal
        assert batch["prompt"][::2] == batch["prompt"][1::2]  # groups stay intact
        kept_first = [r["prompt"] for r in first[p][::2] if _signal(r["prompt"])]
        assert prompts[: len(kept_first)] == kept_first  # the first round's signal groups are all kept
        assert batch["num_items_in_batch"].item() == num_processes * batch["completion_mask"].sum().item()
        assert metrics["dynamic_sampling/rounds"][0] >= 2
        assert metrics["dynamic_sampling/filled_fraction"] == [0.0]
    # Every process took the same decisions and computed the same global draws.
    assert len({tuple(m["dynamic_sampling/rounds"]) for _, m, _ in results}) == 1
    assert len({tuple(m["dynamic_sampling/kept_fraction"]) for _, m, _ in results}) == 1
    assert len({str(draws) for *_, draws in results}) == 1
    # The replacement prompts are the stream's next rows, the data loader's prompts (every process's) passed over.
    draws = [i for draw in results[0][2] for i in draw]
    in_loader_batch = {row["prompt"] for rows in first for row in rows}
    assert draws == _stream_order_without(in_loader_batch, len(draws))
    # No prompt twice in the batch: none across rounds, none across processes.
    batch_prompts = [x for batch, *_ in results for x in batch["prompt"][::2]]
    assert len(set(batch_prompts)) == len(batch_prompts)


def test_the_stream_advances_from_one_batch_to_the_next():
    first = [_rows(["p0", "p1", "p3", "p6"])]
    ((batches, metrics, draws),) = _run_simulated(1, max_rounds=20, first_round=first, steps=2)
    assert len(draws) >= 2 and metrics["dynamic_sampling/filled_fraction"] == [0.0, 0.0]
    first_batch_rounds = int(metrics["dynamic_sampling/rounds"][0]) - 1
    flat = [i for draw in draws for i in draw]
    assert flat == _stream_order_without({"p0", "p1", "p3", "p6"}, len(flat))  # not the same prompts again
    assert set(batches[1]["prompt"][2::2]).isdisjoint(batches[0]["prompt"][2::2])  # new replacements each time
    assert sum(len(d) for d in draws[:first_batch_rounds]) < len(flat)


def test_loop_fills_with_zero_variance_groups_when_the_round_bound_is_hit():
    first = [_rows(["p0", "p1", "p3", "p6"])]  # one group with signal
    ((batch, metrics, draws),) = _run_simulated(1, max_rounds=1, first_round=first)
    assert batch["prompt"][::2] == ["p0", "p1", "p3", "p6"]  # the signal group, then the fillers
    assert metrics["dynamic_sampling/rounds"] == [1.0]
    assert metrics["dynamic_sampling/kept_fraction"] == [0.25]
    assert metrics["dynamic_sampling/filled_fraction"] == [0.75]
    assert draws == []


def test_loop_needs_no_extra_round_when_every_group_has_signal():
    ((batch, metrics, draws),) = _run_simulated(1, max_rounds=20, first_round=[_rows(["p1", "p2", "p4", "p5"])])
    assert batch["prompt"][::2] == ["p1", "p2", "p4", "p5"]
    assert metrics["dynamic_sampling/rounds"] == [1.0] and metrics["dynamic_sampling/kept_fraction"] == [1.0]
    assert draws == []


# -------------------------------------------------------------------------------------------------------- end to end


class RecordingRPGTrainer(RPGTrainer):
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.recorded.append(batch)
        return batch


def test_tiny_training_run_sees_only_groups_with_signal(tiny_model_dir, tmp_path):
    tokenizer = build_char_tokenizer()
    args = RPGConfig(
        **tiny_run_args(
            tmp_path, steps_per_generation=2, max_steps=4, dynamic_sampling=True, dynamic_sampling_max_rounds=8
        )
    )
    trainer = RecordingRPGTrainer(
        tiny_model_dir, sevens_unless_even, args=args, train_dataset=PROMPTS, processing_class=tokenizer
    )
    trainer.recorded = []
    trainer.train()

    assert len(trainer.recorded) == 2  # one generation batch per 2 steps
    rounds = [h["dynamic_sampling/rounds"] for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    kept = [
        h["dynamic_sampling/kept_fraction"] for h in trainer.state.log_history if "dynamic_sampling/kept_fraction" in h
    ]
    assert rounds and max(rounds) >= 2 and min(kept) < 1.0  # even-digit prompts were dropped and replaced
    for batch in trainer.recorded:
        assert batch["completion_ids"].shape[0] == 16  # a full generation batch: 4 groups of 4
        prompts = tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
        groups = batch["advantages"].view(-1, 4)
        for g in range(4):
            group_prompts = set(prompts[4 * g : 4 * g + 4])
            assert len(group_prompts) == 1  # groups stay intact
            assert int(next(iter(group_prompts))[0]) % 2 == 1  # no constant-reward prompt survives
            assert groups[g].abs().max() > 0  # each group carries a reward signal
        assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_a_resumed_run_draws_the_replacement_prompts_the_interrupted_one_would_have(tiny_model_dir, tmp_path):
    """Checkpoint at step 2 (a generation boundary), resume: the generation of step 3 needs replacement prompts; the
    stream's position is in the checkpoint (`rpg_trl.reliability.generation_state`), so the resumed run draws the same ones and continues
    exactly like the uninterrupted run (logs, batches, weights)."""
    tokenizer = build_char_tokenizer()

    def run(output_dir, resume=None):
        args = RPGConfig(
            **tiny_run_args(
                output_dir,
                steps_per_generation=2,
                max_steps=4,
                dynamic_sampling=True,
                dynamic_sampling_max_rounds=8,
                save_strategy="steps",
                save_steps=2,
            )
        )
        trainer = RecordingRPGTrainer(
            tiny_model_dir, sevens_unless_even, args=args, train_dataset=PROMPTS, processing_class=tokenizer
        )
        trainer.recorded = []
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    saved = json.loads((checkpoint / "rpg_prompt_stream.json").read_text())
    assert saved["position"] > 0  # step 1's generation drew replacement prompts
    resumed = run(tmp_path / "resumed", resume=str(checkpoint))

    def after_step_2(trainer):
        timings = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "step_time"}
        return [{k: v for k, v in h.items() if k not in timings} for h in trainer.state.log_history if h["step"] > 2]

    assert any(h.get("dynamic_sampling/rounds", 1) >= 2 for h in after_step_2(full))  # step 3 drew replacements
    assert after_step_2(resumed) == after_step_2(full)
    assert torch.equal(resumed.recorded[0]["prompt_ids"], full.recorded[1]["prompt_ids"])
    assert resumed.prompt_stream.state_dict() == full.prompt_stream.state_dict() != saved
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_two_processes_draw_disjoint_replacement_prompts_from_one_stream(tiny_model_dir, tmp_path):
    """Two gloo processes (tests/helpers/dynamic_sampling_two_proc.py): the data loader's prompts are gathered from
    both, the stream is the same on both, each takes its own slice: no prompt twice in the generation batch, across
    processes included."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(port), str(Path(__file__).parent / "helpers" / "dynamic_sampling_two_proc.py")]
    proc = subprocess.run([*cmd, tiny_model_dir, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] and ranks[0]["rounds"][0] >= 2  # replacements were drawn
    assert ranks[0]["stream"] == ranks[1]["stream"] and ranks[0]["stream"]["position"] > 0
    (batch_0,), (batch_1,) = ranks[0]["batches"], ranks[1]["batches"]
    assert len(batch_0) == len(batch_1) == 4
    assert len(set(batch_0 + batch_1)) == 8  # disjoint, and no prompt twice on a process
    assert all(int(prompt[0]) % 2 == 1 for prompt in batch_0 + batch_1)  # only groups with signal were kept


def test_unknown_metric_name_is_reported(tiny_model_dir, tmp_path):
    args = RPGConfig(
        **tiny_run_args(
            tmp_path, max_completion_length=4, max_steps=1, dynamic_sampling=True, dynamic_sampling_metric="accuracy"
        )
    )
    trainer = RPGTrainer(
        tiny_model_dir, sevens_unless_even, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )
    with pytest.raises(ValueError, match=r"'accuracy'.*sevens_unless_even"):
        trainer.train()


@dataclass
class DynamicGRPOConfig(DynamicSamplingArguments, GRPOConfig):
    """TRL's GRPO configuration with the fields of dynamic sampling (module level: checkpoints pickle it)."""


class DynamicGRPOTrainer(DynamicSamplingMixin, GRPOTrainer):
    """TRL's GRPO with dynamic sampling and none of RPG's other mixins."""


def test_the_mixin_alone_saves_and_restores_its_prompt_stream(tiny_model_dir, tmp_path):
    """DynamicSamplingMixin keeps its own state: on a GRPOTrainer without RPG's other mixins, a run resumed from a
    checkpoint continues the replacement-prompt stream where the interrupted run was (rpg_prompt_stream.json), and
    ends with the uninterrupted run's stream."""

    def run(output_dir, resume=None):
        overrides = dict(max_steps=4, dynamic_sampling=True, dynamic_sampling_max_rounds=8, save_strategy="steps")
        args = DynamicGRPOConfig(**tiny_run_args(output_dir, save_steps=2, **overrides))
        trainer = DynamicGRPOTrainer(
            tiny_model_dir,
            sevens_unless_even,
            args=args,
            train_dataset=PROMPTS,
            processing_class=build_char_tokenizer(),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    saved = json.loads((checkpoint / PROMPT_STREAM_FILE).read_text())
    assert saved["position"] > 0  # the first steps drew replacement prompts
    resumed = run(tmp_path / "resumed", resume=str(checkpoint))
    assert full.prompt_stream.state_dict() != saved  # steps 3-4 drew more
    assert resumed.prompt_stream.state_dict() == full.prompt_stream.state_dict()
