"""A tiny transformers Trainer job (2-layer BERT built from a config, synthetic data), for
tests/e2e/test_frameworks.py. Run under torch.distributed.run on CPU with gloo.

    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_trainer.py --out DIR
"""
import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Synthetic(torch.utils.data.Dataset):
    """Fixed random token ids and labels: no hub, no download."""

    def __init__(self, n: int = 32, seq: int = 8, vocab: int = 100):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-on-each-node", action="store_true",
                        help="TrainingArguments(save_on_each_node=True): local rank 0 of every "
                             "node saves (meant for node-local storage)")
    args = parser.parse_args()
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    training_args = TrainingArguments(
        output_dir=args.out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
        save_strategy="steps", save_steps=2, max_steps=4, report_to=[], logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, save_on_each_node=args.save_on_each_node)
    Trainer(model=model, args=training_args, train_dataset=Synthetic()).train()


if __name__ == "__main__":
    main()
