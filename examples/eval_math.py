# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""
mean@n and pass@k accuracy on the paper's benchmarks (AIME24, AIME25, AMC23) or any local math file.

The paper reports mean@32: the accuracy of 32 sampled responses per problem, averaged over samples and problems
(Sec. 5). pass@k uses the unbiased estimator of Chen et al. (2021): with c correct responses among n,
pass@k = 1 − C(n − c, k) / C(n, k), averaged over problems. Responses are scored with
`rpg_trl.math_task.rewards.accuracy_reward` (the training reward: the last "Answer:" line, compared with math-verify).
Generation uses vLLM when it is installed and a GPU is present, transformers' `generate` otherwise. A folder saved by a
LoRA run (`adapter_config.json`) is merged into its base model first.

    python examples/eval_math.py --model_name_or_path runs/rpg-reinforce-urkl --num_samples 32 \
        --max_new_tokens 8192 --output_dir runs/rpg-reinforce-urkl/eval
    python examples/eval_math.py --model_name_or_path Qwen/Qwen3-4B --datasets aime25 my_problems.jsonl

Writes `results.json` (every number, the settings and per-problem correct counts) and `results.md` (a table) to
`--output_dir`.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from trl import TrlParser

from rpg_trl.math_task.data import load_aime24, load_aime25, load_amc23, load_math_dataset
from rpg_trl.math_task.rewards import accuracy_reward


#: Benchmarks known by name (the paper's); anything else is a local file/folder or a Hub dataset id.
BENCHMARKS = {"aime24": load_aime24, "aime25": load_aime25, "amc23": load_amc23}


@dataclass
class EvalArguments:
    model_name_or_path: str = field(
        default=None, metadata={"help": "Model to evaluate: a Hub id or a local folder (full model or LoRA adapter)."}
    )
    datasets: list[str] = field(
        default_factory=lambda: ["aime24", "aime25", "amc23"],
        metadata={"help": "Benchmarks: 'aime24', 'aime25', 'amc23', or local .jsonl/.json/.parquet files or Hub ids."},
    )
    split: str = field(default="test", metadata={"help": "Split of the datasets given as files or Hub ids."})
    max_samples: int | None = field(default=None, metadata={"help": "Keep only the first N problems of each set."})
    num_samples: int = field(default=32, metadata={"help": "n, responses sampled per problem (paper: 32)."})
    pass_k: list[int] = field(
        default_factory=lambda: [1, 4, 16, 32], metadata={"help": "k values of pass@k (those <= num_samples)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training used 1.0); 0: greedy."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (training used 1.0)."})
    max_new_tokens: int = field(default=8192, metadata={"help": "Response budget in tokens (the training context)."})
    enable_thinking: bool | None = field(
        default=None, metadata={"help": "Passed to the chat template (Qwen3's thinking switch); None: the default."}
    )
    batch_size: int = field(default=8, metadata={"help": "Problems per `generate` call (transformers backend)."})
    use_vllm: bool | None = field(
        default=None, metadata={"help": "Generate with vLLM. None: when vLLM is installed and a GPU is present."}
    )
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM's share of GPU memory."})
    dtype: str = field(default="auto", metadata={"help": "Model dtype: 'auto', 'bfloat16', 'float16', 'float32'."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    output_dir: str = field(default="eval_results", metadata={"help": "Where results.json and results.md go."})
    save_completions: bool = field(default=False, metadata={"help": "Also write every response to completions.jsonl."})


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct responses among `n` (Chen et al., 2021, Eq. 1)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"Need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def load_eval_sets(names: list[str], split: str = "test", max_samples: int | None = None) -> dict:
    """`{name: dataset}` with `prompt` (the paper's prompt, as chat messages) and `solution` columns."""
    eval_sets = {}
    for name in names:
        if name in BENCHMARKS:
            eval_sets[name] = BENCHMARKS[name](max_samples=max_samples)
        else:
            eval_sets[Path(name).stem] = load_math_dataset(name, split, max_samples=max_samples, deduplicate=True)
    return eval_sets


def resolve_model(args: EvalArguments) -> str:
    """The model folder to load: LoRA adapters are merged into their base model (saved under output_dir)."""
    path = Path(args.model_name_or_path)
    if not (path / "adapter_config.json").is_file():
        return args.model_name_or_path
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    merged = Path(args.output_dir) / "merged_model"
    model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    model.merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(path).save_pretrained(merged)
    return str(merged)


def vllm_generator(args: EvalArguments, model_path: str):
    """`texts -> n responses per text`, with vLLM (the model is loaded once)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_path,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
    )
    params = SamplingParams(
        n=args.num_samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_new_tokens,
        seed=args.seed,
    )

    def generate(texts: list[str]) -> list[list[str]]:
        return [[o.text for o in output.outputs] for output in llm.generate(texts, params, use_tqdm=True)]

    return generate


def transformers_generator(args: EvalArguments, model_path: str, tokenizer):
    """`texts -> n responses per text`, with transformers' `generate` on the GPU if there is one, else the CPU."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (
        AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        .to(device)
        .eval()
    )
    greedy = args.temperature == 0  # one greedy response, repeated n times
    copies = 1 if greedy else args.num_samples
    sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    )

    def generate(texts: list[str]) -> list[list[str]]:
        responses = []
        for start in tqdm(range(0, len(texts), args.batch_size), desc="Generating", unit="batch"):
            batch = tokenizer(
                texts[start : start + args.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=args.max_new_tokens,
                    num_return_sequences=copies,
                    pad_token_id=tokenizer.pad_token_id,
                    **sampling,
                )
            decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            responses += [
                decoded[i : i + copies] * (args.num_samples // copies) for i in range(0, len(decoded), copies)
            ]
        return responses

    return generate


def score(dataset, responses: list[list[str]], n: int, ks: list[int]) -> dict:
    flat = [r for group in responses for r in group]
    solutions = [s for s in dataset["solution"] for _ in range(n)]
    rewards = np.array(accuracy_reward(flat, solutions), dtype=float).reshape(len(dataset), n)
    correct = rewards.sum(axis=1).astype(int).tolist()
    return {
        "num_problems": len(dataset),
        "num_samples": n,
        f"mean@{n}": float(rewards.mean()) if len(dataset) else math.nan,
        "pass@k": {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks},
        "correct_per_problem": correct,
    }


def markdown_table(model: str, results: dict, n: int, ks: list[int]) -> str:
    header = ["dataset", "problems", f"mean@{n}", *(f"pass@{k}" for k in ks)]
    lines = [f"**{model}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        row = [name, str(r["num_problems"]), f"{r[f'mean@{n}']:.4f}", *(f"{r['pass@k'][f'pass@{k}']:.4f}" for k in ks)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(args: EvalArguments):
    if args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (a Hub id or a local folder).")
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1; got {args.num_samples}.")
    import torch
    from transformers import AutoTokenizer

    ks = sorted({k for k in args.pass_k if 1 <= k <= args.num_samples})
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    use_vllm = args.use_vllm
    if use_vllm is None:
        use_vllm = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    if use_vllm and importlib.util.find_spec("vllm") is None:
        raise ImportError("--use_vllm needs vLLM: `pip install vllm` (or drop the flag to use transformers).")

    # ---- data and prompts (the paper's prompt through the model's chat template, as in training)
    eval_sets = load_eval_sets(args.datasets, args.split, args.max_samples)
    model_path = resolve_model(args)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    tokenizer.padding_side = "left"
    template_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}

    # ---- generate and score each set
    if use_vllm:
        generate = vllm_generator(args, model_path)
    else:
        generate = transformers_generator(args, model_path, tokenizer)
    results, records = {}, []
    for name, dataset in eval_sets.items():
        texts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **template_kwargs)
            for p in dataset["prompt"]
        ]
        print(f"{name}: {len(texts)} problems x {args.num_samples} samples ({'vLLM' if use_vllm else 'transformers'})")
        responses = generate(texts)
        results[name] = score(dataset, responses, args.num_samples, ks)
        print(f"{name}: mean@{args.num_samples} = {results[name][f'mean@{args.num_samples}']:.4f}")
        if args.save_completions:
            records += [
                {"dataset": name, "problem": i, "solution": sol, "response": r}
                for i, (sol, group) in enumerate(zip(dataset["solution"], responses))
                for r in group
            ]

    # ---- write JSON and markdown
    backend = "vllm" if use_vllm else "transformers"
    report = {"model": args.model_name_or_path, "backend": backend, "settings": asdict(args), "results": results}
    (output_dir / "results.json").write_text(json.dumps(report, indent=2))
    table = markdown_table(args.model_name_or_path, results, args.num_samples, ks)
    (output_dir / "results.md").write_text(table)
    if records:
        with open(output_dir / "completions.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(table)
    return report


if __name__ == "__main__":
    main(TrlParser((EvalArguments,)).parse_args_and_config()[0])
