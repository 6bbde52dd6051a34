"""The model card of an exported run (`README.md` in the folder `brigade export` writes), in the
Hub's format: YAML metadata, then what a reader deciding whether to use the adapter needs: the
base, the data and rewards, the held-out curve and the final score, the health figures the source
essay's checklist asks for, how to load it, and the run spec it came from."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

# (metric key, what the card calls it): the essay's checklist, averaged over the run's steps
HEALTH = [
    ("rejection_rate", "rejection rate (batches refused: stale, invalid, corrupt)"),
    ("staleness_mean", "staleness (versions between sampling and training)"),
    ("clip_low_frac", "tokens clipped below the trust region"),
    ("clip_high_frac", "tokens clipped above the trust region"),
    ("is_weight_capped_frac", "importance weights truncated at tis_cap"),
    ("kl", "KL to the base model"),
    ("wait_frac", "learner idle (waiting for rollouts)"),
    ("dollars_per_sample", "dollars per usable sample"),
]


def model_card(record, version: int, base, merged: bool, plots: list[str]) -> str:
    from brigade.spec_file import spec_to_dict

    spec = record.spec
    score = record.heldout(version)
    from brigade_cli.plots import best_version

    scored = list(record.scores.items())
    best = best_version(record.scores)
    rewards = ", ".join(f"`{r.function}`" + (f" (weight {r.weight:g})" if r.weight != 1 else "") for r in spec.rewards)
    meta = {"library_name": "transformers" if merged else "peft", "pipeline_tag": "text-generation",
            "tags": ["brigade", "grpo", "lora", "reinforcement-learning"]}
    if base.hub_id:
        meta["base_model"] = base.hub_id
    if _hub_dataset(spec.dataset):
        meta["datasets"] = [spec.dataset]
    if base.conversion and base.conversion.get("gguf_metadata", {}).get("general.license"):
        meta["license"] = base.conversion["gguf_metadata"]["general.license"]
    what = "the base model with a GRPO-trained LoRA adapter merged in" if merged else "a GRPO-trained LoRA adapter"
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
        f"# {record.run}: adapter version {version}", "",
        f"{what[0].upper() + what[1:]} for `{base.name_or_path}`, trained by brigade (asynchronous "
        f"GRPO: one learner, preemptible rollout workers, a bucket between them) on `{spec.dataset}` with the "
        f"reward functions {rewards or '(none recorded)'}.", "",
        "## Result", "",
        "| | |", "|---|---|",
        f"| adapter version | v{version} of {len(record.versions)} published |",
        f"| learner step | {record.steps.get(version, '?')} of {spec.max_steps or 'unbounded'} |",
        f"| held-out score | {_num(score)} |",
        f"| best held-out score | {_num(best[1]) + f' (v{best[0]})' if best else '-'} |",
        f"| samples trained on | {sum(m.get('accepted_samples', 0) for m in record.metrics)} |", "",
        "The held-out score is the evaluator's: the mean total reward (or accuracy, for a recipe that "
        "reports one) of a few completions per held-out prompt at the run's temperature, the same seed "
        "for every version.", "",
    ]
    if scored:
        lines += ["## Held-out curve", "", "| version | step | held-out |", "|---|---|---|"]
        lines += [f"| v{v} | {record.steps.get(v, '?')} | {_num(s)} |" for v, s in scored]
        lines.append("")
    lines += [f"![{name}]({name})" for name in plots] + ([""] if plots else [])
    health = [(label, _mean(record.metrics, key)) for key, label in HEALTH]
    if record.metrics:
        lines += ["## Training health", "", f"Means over the {len(record.metrics)} learner steps.", "",
                  "| figure | mean |", "|---|---|"]
        # dollars stay 0 when no service was given a price (--price-per-hour): nothing to show then
        lines += [f"| {label} | {_num(value)} |" for label, value in health
                  if value is not None and not (label.startswith("dollars") and value == 0)]
        lines.append("")
    loader = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              "model = AutoModelForCausalLM.from_pretrained(FOLDER)") if merged else (
              "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n"
              "model = AutoPeftModelForCausalLM.from_pretrained(FOLDER)")
    lines += ["## Use", "", "```python", loader, "tokenizer = AutoTokenizer.from_pretrained(FOLDER)  # with its chat "
              "template", "```", "", "`FOLDER` is this folder, or this repository's id on the Hub.", "",
              "## Base model", "", f"`{base.name_or_path}`: {base.origin}."]
    if base.revision:
        lines.append(f"Revision `{base.revision}`.")
    if base.conversion:
        lines += ["", "The conversion:", "", "```json", _json(base.conversion), "```"]
    if not base.hub_id:
        lines += ["", "The base is a local folder: on another machine, put the same model there or set "
                  "`base_model_name_or_path` in `adapter_config.json` to where it is."]
    lines += ["", "## Run spec", "", "```yaml", yaml.safe_dump(spec_to_dict(spec), sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def _hub_dataset(name: str) -> bool:
    """A dataset named by its Hub id (`org/name`), not a path, a bucket URI or brigade's demo."""
    return name.count("/") == 1 and "://" not in name and not Path(name).exists() and not name.startswith((".", "~"))


def _mean(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if isinstance(m.get(key), int | float) and math.isfinite(m[key])]
    return sum(values) / len(values) if values else None


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _json(data: dict) -> str:
    import json

    return json.dumps(data, indent=2)
