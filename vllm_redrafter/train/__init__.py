"""Training a ReDrafter drafter by knowledge distillation from a frozen target.

    vllm-redrafter train --recipe shipped --output-dir runs/shipped      # the shipped drafter
    vllm-redrafter train --recipe default --output-dir runs/default      # its base, from scratch
    vllm-redrafter train --recipe quick --output-dir /tmp/quick           # minutes, tests use it
    vllm-redrafter train --target MODEL --dataset data.jsonl --output-dir DIR [--labels self]

The pipeline (one module per step):

- ``data.py``      read a local dataset (chat ``messages``, ShareGPT ``conversations``,
                   ``prompt``, ``text``, pre-tokenized ``input_ids``, or a plain text file) and
                   render it with the target's chat template; bad input is a ``DatasetError``
                   naming the file and line.
- ``prompts.py``   the built-in dataset, made locally: templated instructions, requests over
                   English text shipped with installed packages, and questions the target writes
                   itself. Never the MT-Bench questions (the evaluation set).
- ``generate.py``  vLLM alone (``VLLM_PLUGINS=""``) in a subprocess, batched, resumable by shard.
- ``distill.py``   (h_t, g0_t, labels_t) for training positions: the target's own greedy
                   continuation (``self`` / ``distill``) or the text (``ground-truth``); h_t from
                   the frozen target (transformers, batched), stored as float16.
- ``vocab.py``     the reduced draft vocabulary: the K most frequent training tokens.
- ``trainer.py``   the loss (sum over T positions of CE, teacher forcing through the RNN),
                   resumable checkpoints, held-out per-position top-1 accuracy.
- ``pipeline.py``  one run: output-dir checks, data, K, drafter init, training, eval, save.
- ``recipes.py``   named recipes (``default``, ``quick``) and why their settings.

The drafter is saved in Apple's ml-recurrent-drafter layout (``RecurrentDrafter.save_pretrained``)
with this project's reduced-vocabulary extension: ``draft_vocab_size: K`` in ``config.json`` and a
``draft_vocab_ids`` int64 tensor [K] (the target ids of the head's K outputs) in
``model.safetensors``.
"""
