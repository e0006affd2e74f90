"""End-to-end tests of the paper's math recipe: `examples/rpg_math.py` under `accelerate launch` (1 and 2 CPU
processes), the GRPO/DAPO baselines, `examples/eval_math.py`, every recipe YAML and accelerate config. CPU only,
offline: a tiny local Qwen3 and a tiny local JSONL of "What is a+b?" problems (the tiny model answers wrong; fine)."""

import ast
import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import PropertyMock, patch

import pytest


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from rpg_trl import RPGConfig  # noqa: E402
from rpg_trl.testing import no_activation_checkpointing  # noqa: E402

import eval_math  # noqa: E402
import rpg_math  # noqa: E402
from helpers.ports import free_port  # noqa: E402


ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
    "OMP_NUM_THREADS": "1",
}
TIMEOUT = 240


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen3 whose character tokenizer covers the paper's prompt, and tiny train/eval JSONL files."""
    from helpers.tiny_runs import save_math_assets

    return save_math_assets(tmp_path_factory.mktemp("math"))


def _train_args(assets, output_dir, *extra):
    return [
        "--model_name_or_path",
        assets["model"],
        "--train_dataset",
        assets["train"],
        "--eval_datasets",
        assets["eval"],
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "2",
        "--num_generations",
        "4",
        "--steps_per_generation",
        "2",
        "--max_completion_length",
        "16",
        "--overlong_buffer",
        "16",
        "--dynamic_sampling",
        "--dynamic_sampling_max_rounds",
        "3",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        f"--{next(iter(no_activation_checkpointing()))}",  # activation_checkpointing where it exists
        "false",
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "true",
        *extra,
    ]


def _logged(stdout):
    """The metric dicts the trainer printed."""
    return [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'")]


def _launch(launcher_args, script_args, cwd):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher_args,
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(EXAMPLES / "rpg_math.py"),
        *script_args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=ENV, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope="module")
def lora_run(assets):
    """`accelerate launch --cpu --num_processes 1`: RPG with LoRA, dynamic sampling and periodic evaluation."""
    output_dir = assets["root"] / "rpg-lora"
    result = _launch(
        ["--cpu", "--num_processes", "1"],
        _train_args(
            assets,
            output_dir,
            "--per_device_train_batch_size",
            "8",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "1",
            "--per_device_eval_batch_size",
            "4",
            "--num_generations_eval",
            "2",
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--lora_target_modules",
            "all-linear",
        ),
        cwd=assets["root"],
    )
    return result, output_dir


@pytest.mark.slow
def test_rpg_math_one_process_lora_with_periodic_eval(lora_run):
    result, output_dir = lora_run
    assert "RPG-REINFORCE-URKL" in result.stdout and "with 1 process(es)" in result.stdout
    logs = _logged(result.stdout)
    assert sum("loss" in log for log in logs) == 2
    rounds = [int(log["dynamic_sampling/rounds"]) for log in logs if "dynamic_sampling/rounds" in log]
    assert rounds and all(1 <= r <= 3 for r in rounds)
    evals = [
        float(log["eval_tiny_eval_rewards/accuracy_reward/mean"])
        for log in logs
        if "eval_tiny_eval_rewards/accuracy_reward/mean" in log
    ]
    assert len(evals) == 2 and all(0.0 <= x <= 1.0 for x in evals)  # after steps 1 and 2
    assert (output_dir / "adapter_config.json").is_file() and (output_dir / "tokenizer.json").is_file()


def _readme_command(config_file: str) -> list[str]:
    """The README's `accelerate launch --config_file accelerate_configs/CONFIG_FILE ...` line, split into words."""
    import shlex

    prefix = f"accelerate launch --config_file accelerate_configs/{config_file} "
    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(prefix)]
    return shlex.split(line)


@pytest.mark.slow
def test_the_readme_lora_command_trains_a_tiny_model_on_cpu(assets):
    """The README's LoRA-on-one-GPU command, as written (its accelerate config and recipe), with only what a CPU and
    a tiny model need changed on the command line: the launcher's precision, the model and data, the recipe's GPU-only
    settings (bf16, vLLM, fused AdamW) and its batch scaled down. It trains the recipe's rank-64 adapter."""
    import yaml

    words = _readme_command("single_gpu.yaml")
    assert words[:4] == ["accelerate", "launch", "--config_file", "accelerate_configs/single_gpu.yaml"]
    script, flag, recipe = words[4:]
    assert (script, flag) == ("examples/rpg_math.py", "--config") and "lora" in recipe
    settings = yaml.safe_load((ROOT / recipe).read_text())
    assert settings["use_peft"] is True and settings["lora_r"] == 64
    output_dir = assets["root"] / "readme-lora"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / words[3])]
    command += ["--cpu", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / script), "--config"]
    command += [str(ROOT / recipe)]
    command += [  # the tiny model and data; a batch of 8 completions, 2 optimizer steps per generation
        "--model_name_or_path", assets["model"], "--train_dataset", assets["train"], "--eval_datasets", assets["eval"],
        "--output_dir", str(output_dir), "--max_steps", "2", "--warmup_steps", "0", "--num_generations", "4",
        "--generation_batch_size", "16", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--max_completion_length", "16", "--overlong_buffer", "16", "--dynamic_sampling_max_rounds", "2",
        "--eval_steps", "2", "--num_generations_eval", "2", "--per_device_eval_batch_size", "4", "--save_steps", "2",
        "--logging_steps", "1", "--learning_rate", "1e-3",
    ]  # fmt: skip
    command += [  # what a CPU does not have
        "--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--use_vllm", "false", "--optim", "adamw_torch",
        f"--{next(iter(no_activation_checkpointing()))}", "false", "--disable_tqdm", "true",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=ENV, cwd=assets["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "RPG-REINFORCE-URKL" in result.stdout and "with 1 process(es)" in result.stdout
    logs = _logged(result.stdout)
    assert sum("loss" in log for log in logs) == 2
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["r"] == 64 and adapter["lora_alpha"] == 128  # the recipe's adapter, not a default one
    assert (output_dir / "checkpoint-2" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_rpg_math_two_processes(assets):
    # `accelerate launch --cpu` starts one process unless MPI is set up; `--multi_gpu` wraps torchrun, and the
    # trainer (`--use_cpu`) then joins a gloo process group on CPU.
    # With dynamic sampling (both processes take the same decisions from gathered rewards); the run ends cleanly at exit
    # (rpg_trl/reliability/teardown.py holds the gloo group until then).
    output_dir = assets["root"] / "rpg-ddp"
    args = _train_args(
        assets,
        output_dir,
        "--per_device_train_batch_size",
        "4",
        "--divergence",
        "ufkl",
        "--estimator",
        "differentiable",
    )
    result = _launch(
        ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())], args, cwd=assets["root"]
    )
    assert "RPG-UFKL" in result.stdout and "with 2 process(es)" in result.stdout
    logs = _logged(result.stdout)
    assert sum("loss" in log for log in logs) == 2
    assert any("dynamic_sampling/kept_fraction" in log for log in logs)
    assert (output_dir / "model.safetensors").is_file()


def test_baselines_share_everything_but_the_loss_with_rpg():
    """RPG and every baseline of the script have the same parts around the loss (the mixins in their class lines)."""
    from rpg_trl.dynamic_sampling import DynamicSamplingMixin
    from rpg_trl.reliability import ReliabilityMixin

    # REINFORCE++ (the research package's): research/tests/test_reinforce_plus_plus.py
    for trainer in (rpg_math.MathRPGTrainer, rpg_math.BaselineTrainer):
        assert issubclass(trainer, ReliabilityMixin) and issubclass(trainer, DynamicSamplingMixin), trainer
    for config in (rpg_math.RPGConfig, rpg_math.BaselineConfig):
        assert {"dynamic_sampling", "dynamic_sampling_max_rounds", "dynamic_sampling_metric"} <= set(
            config.__dataclass_fields__
        )
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds"):
        rpg_math.BaselineConfig(output_dir="unused", use_cpu=True, report_to="none", dynamic_sampling_max_rounds=0)


@pytest.mark.parametrize("algorithm, loss_type", [("grpo", "grpo"), ("dapo", "dapo")])
def test_baselines_train_with_trl_losses(assets, tmp_path, algorithm, loss_type):
    parser = rpg_math.make_parser()
    args = parser.parse_args_and_config(
        _train_args(
            assets,
            tmp_path,
            "--algorithm",
            algorithm,
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "1",
            "--eval_strategy",
            "no",
        )
    )
    with pytest.warns(UserWarning, match=f"--algorithm {algorithm} runs the paper's baseline"):
        config = rpg_math.baseline_config(args[1], algorithm)  # RPG's defaults differ from the baseline's
    assert type(config).__name__ == "BaselineConfig" and config.loss_type == loss_type
    assert (config.epsilon, config.epsilon_high) == ((0.1, 0.1) if algorithm == "grpo" else (0.2, 0.28))
    assert config.dynamic_sampling and config.steps_per_generation == args[1].steps_per_generation
    with pytest.warns(UserWarning):
        rpg_math.main(*args)
    assert (tmp_path / "model.safetensors").is_file()


def test_the_reinforce_plus_plus_baselines_without_the_research_package_are_refused_naming_it(monkeypatch):
    """--algorithm rfpp and rfppb train the research package's REINFORCE++ (its own tests train them through this
    script: research/tests/test_reinforce_plus_plus.py); without that package, the script names it and how to install
    it, when the baseline is chosen, not when the script is imported."""
    monkeypatch.setitem(sys.modules, "rpg_research", None)  # `from rpg_research import ...` raises ImportError
    with pytest.raises(ImportError) as refused:
        rpg_math.reinforce_plus_plus()
    assert str(refused.value) == (
        "--algorithm rfpp and rfppb train the REINFORCE++ baselines of rpg_trl's research package, which is not "
        "installed: `pip install -e ./research` in a clone of rpg_trl."
    )


# --------------------------------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 1, 0.0),
        (4, 4, 4, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 2, 2, 5 / 6),
        (5, 2, 3, 0.9),
        (3, 1, 3, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    # 1 - C(n-c, k) / C(n, k): e.g. n=4, c=2, k=2: 1 - 1/6; n=5, c=2, k=3: 1 - 1/10.
    assert eval_math.pass_at_k(n, c, k) == pytest.approx(expected)
    with pytest.raises(ValueError):
        eval_math.pass_at_k(4, 5, 1)


def test_score_and_table_from_hand_made_responses():
    dataset = {"solution": ["5", "7"]}
    responses = [["Answer: 5", "Answer: 4", "so 5", "Answer: 5"], ["Answer: 7", "Answer: 7", "x", "Answer: 7"]]

    class Rows(dict):
        def __len__(self):
            return 2

    result = eval_math.score(Rows(dataset), responses, n=4, ks=[1, 2])
    assert result["correct_per_problem"] == [2, 3]
    assert result["mean@4"] == pytest.approx(5 / 8)
    assert result["pass@k"]["pass@1"] == pytest.approx(5 / 8)
    assert result["pass@k"]["pass@2"] == pytest.approx(((1 - 1 / 6) + 1.0) / 2)
    table = eval_math.markdown_table("m", {"set": result}, 4, [1, 2])
    assert "| set | 2 | 0.6250 | 0.6250 | 0.9167 |" in table


@pytest.mark.slow
def test_eval_math_scores_the_trained_lora_model(lora_run, assets, tmp_path):
    _, model_dir = lora_run
    from trl import TrlParser

    (args,) = TrlParser((eval_math.EvalArguments,)).parse_args_and_config(
        [
            "--model_name_or_path",
            str(model_dir),
            "--datasets",
            assets["eval"],
            "--num_samples",
            "4",
            "--pass_k",
            "1",
            "2",
            "8",
            "--max_new_tokens",
            "8",
            "--output_dir",
            str(tmp_path),
        ]
    )
    report = eval_math.main(args)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"] == report["results"]
    result = saved["results"]["tiny_eval"]
    assert result["num_problems"] == 4 and result["num_samples"] == 4
    assert 0.0 <= result["mean@4"] <= result["pass@k"]["pass@2"] <= 1.0
    assert set(result["pass@k"]) == {"pass@1", "pass@2"}  # k <= n only
    assert (tmp_path / "merged_model" / "config.json").is_file()  # the adapter was merged into its base
    assert "| tiny_eval | 4 |" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------------------------------- recipes and launch files
RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "*.yaml")))


def test_there_is_a_recipe_per_paper_setting():
    names = {Path(p).stem for p in RECIPES}
    assert {
        "rpg_reinforce_urkl",
        "rpg_reinforce_ufkl",
        "rpg_urkl",
        "rpg_ufkl",
        "grpo",
        "dapo",
        "lora_qwen3_1.7b",
        "lora_qwen3_4b",
        "rpg_reinforce_urkl_schedule_free",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: Path(p).stem)
def test_recipe_parses_with_the_paper_batch(recipe):
    """Every recipe loads through the script's parser (no training); the batch arithmetic gives the paper's 16
    optimizer steps per generation batch on the GPUs the recipe is written for."""
    single_gpu = "lora" in Path(recipe).stem
    with patch.object(RPGConfig, "world_size", new_callable=PropertyMock, return_value=1 if single_gpu else 8):
        # `use_cpu` only because this machine has no GPU for `bf16: true`.
        script_args, args, model_args = rpg_math.make_parser().parse_args_and_config(
            ["--config", recipe, "--use_cpu", "true"]
        )
        assert args.steps_per_generation // args.gradient_accumulation_steps == 16
        prompts_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        prompts_per_step = prompts_per_step * (1 if single_gpu else 8) // args.num_generations
        assert prompts_per_step == (8 if single_gpu else 32)
        if script_args.algorithm != "rpg":  # the recipe states exactly what BASELINES runs
            for key, value in rpg_math.BASELINES[script_args.algorithm].items():
                assert getattr(args, key) == value, key
            rpg_math.baseline_config(args, script_args.algorithm)
    assert model_args.model_name_or_path.startswith("Qwen/Qwen3-")
    assert args.dynamic_sampling and args.dynamic_sampling_metric == "accuracy_reward"
    assert args.learning_rate == (1e-5 if single_gpu else 1e-6) and args.weight_decay == 0.1
    assert args.max_grad_norm == 1.0 and args.temperature == 1.0 and args.beta in (0.0, 1e-4)
    assert script_args.overlong_buffer == args.max_completion_length // 4
    assert (model_args.use_peft, args.use_vllm) == (single_gpu, True)


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "accelerate_configs" / "*.yaml"))), ids=os.path.basename)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(path)
    assert config.mixed_precision == "bf16" and config.num_processes >= 1


@pytest.mark.slow
def test_slurm_script_is_valid_bash():
    script = ROOT / "accelerate_configs" / "slurm_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "trl vllm-serve" in text and "--vllm_mode server" in text and "multi_node.yaml" in text
