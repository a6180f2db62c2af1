"""specdec's own instruction prompts, for calibrating and training drafters on what the target writes.

Tasks x topics x formats, drawn reproducibly from a seed. Written for specdec; nothing here comes from a
benchmark (Spec-Bench questions are what drafters are measured on, so they are never trained on).
"""
from __future__ import annotations

import numpy as np

TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
    "machine learning", "the Roman Empire", "climate change", "vaccines", "the stock market", "volcanoes",
    "the human heart", "electric cars", "the printing press", "coffee", "honeybees", "the moon landing",
    "renewable energy", "sleep", "the internet", "chess", "jazz music", "the immune system", "earthquakes",
    "recycling", "the Great Wall of China", "inflation", "DNA", "social media", "marathon training",
    "bread baking", "time zones", "the Pythagorean theorem", "supply and demand", "rainforests",
    "public libraries", "the periodic table", "remote work", "ancient Egypt", "bicycles", "gardening",
    "password security", "the Olympic Games", "coral reefs", "budgeting", "Shakespeare", "glaciers",
    "solar panels", "friendship", "city planning", "sorting algorithms", "a job interview", "tea",
)

TASKS = (
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give three interesting facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "List five questions a student might ask about {t}, with short answers.",
    "Write a short story that involves {t}.",
    "Describe {t} as if you were a tour guide.",
    "What is a common misconception about {t}? Correct it.",
    "Write a tweet announcing a new discovery about {t}.",
    "Compare {t} and {u} in a short table.",
    "Write an email to a friend recommending they learn about {t}.",
    "Give step-by-step instructions for a beginner interested in {t}.",
    "Write a dialogue between a teacher and a student about {t}.",
    "Explain how {t} relates to {u}.",
    "Write a persuasive argument for why everyone should care about {t}.",
    "Create a quiz with three multiple-choice questions about {t}.",
    "Describe {t} in exactly two sentences.",
    "Write a limerick about {t}.",
    "What would happen if {t} suddenly disappeared?",
    "Outline a five-minute presentation on {t}.",
    "Translate this sentence into French and explain it: 'I would like to learn more about {t}.'",
    "Write a product description for a book about {t}.",
    "Write Python code that prints three facts about {t}, one per line.",
    "Rewrite this sentence more formally: 'honestly {t} is kind of a big deal'.",
    "Give a one-paragraph news report about {t}.",
    "What are the key terms someone should know about {t}? Define each briefly.",
)

FOLLOW_UPS = ("Can you make it shorter?", "Now explain it in more detail.", "Give me an example.",
              "Why is that important?", "Can you put that in a list?")


def instruction_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat conversations ending in a user turn: varied tasks and topics, some with a follow-up turn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t, u = rng.choice(len(TOPICS), size=2, replace=False)
        task = TASKS[int(rng.integers(len(TASKS)))].format(t=TOPICS[t], u=TOPICS[u])
        if rng.random() < 0.15:  # a second turn: the model also writes after its own earlier answer
            other = TASKS[int(rng.integers(len(TASKS)))].format(t=TOPICS[u], u=TOPICS[t])
            out.append([{"role": "user", "content": other},
                        {"role": "assistant", "content": f"Here is a short answer about {TOPICS[u]}."},
                        {"role": "user", "content": FOLLOW_UPS[int(rng.integers(len(FOLLOW_UPS)))] + " " + task}])
        else:
            out.append([{"role": "user", "content": task}])
    return out


def target_answers(model, tokenizer, conversations: list, new_tokens: int, batch: int = 32) -> list[tuple[np.ndarray, int]]:
    """The target's greedy answers, batched with left padding: per conversation (prompt + answer ids up to and
    including the first EOS, prompt length). Sets left padding (and a pad token if it has none) on `tokenizer`."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = {int(tokenizer.eos_token_id)}
    out = []
    for i in range(0, len(conversations), batch):
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations[i:i + batch]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        width = enc["input_ids"].shape[1]
        for row, mask in zip(gen, enc["attention_mask"]):
            prompt = row[:width][mask.bool()].numpy()
            answer = row[width:].numpy()
            stop = next((j + 1 for j, t in enumerate(answer) if int(t) in eos), len(answer))
            out.append((np.concatenate([prompt, answer[:stop]]).astype(np.int64), len(prompt)))
    return out
