"""The "broad" instruction set for distillation data: many task families, written for specdec.

The first built-in set (prompts.py, `basic`) crossed 28 task templates with 53 topics: ~1,500 distinct prompts,
so a head trained on thousands of them met the same prompts again in its "held-out" ones and never met long
inputs, sums, code, translation or reading tasks. This set draws from families shaped like what people ask a
chat model (open writing, explanations, role-play, puzzles, word problems, code, translation, short factual
questions, and reading tasks over documents), each from its own vocabulary, so that distinct prompts number in
the millions. Nothing here comes from a benchmark; distill-data also drops any prompt equal to a Spec-Bench one.

Reading tasks (summarize, extract, answer from passages) need documents: the target's own earlier answers from a
distill-data folder (`--documents DIR`), concatenated up to several hundred tokens, as summarization and
retrieval-augmented prompts are long.
"""
from __future__ import annotations

import numpy as np

SUBJECTS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle", "machine "
    "learning", "the Roman Empire", "climate change", "vaccines", "the stock market", "volcanoes", "the human heart",
    "electric cars", "the printing press", "coffee", "honeybees", "the moon landing", "renewable energy", "sleep",
    "the internet", "chess", "jazz music", "the immune system", "earthquakes", "recycling", "inflation", "DNA",
    "social media", "marathon training", "bread baking", "time zones", "supply and demand", "rainforests",
    "the periodic table", "remote work", "ancient Egypt", "bicycles", "password security", "coral reefs",
    "Shakespeare", "glaciers", "city planning", "sorting algorithms", "quantum computing", "plate tectonics",
    "the Renaissance", "antibiotics", "cryptocurrency", "the Silk Road", "urban gardening", "nuclear fusion",
    "the Industrial Revolution", "game theory", "migratory birds", "public transport", "the Cold War",
    "artificial sweeteners", "the placebo effect", "3D printing", "opera", "minimalism", "the gig economy",
    "desert ecosystems", "Mars exploration", "the Byzantine Empire", "microplastics", "impressionist painting",
    "the Fibonacci sequence", "blood types", "wind turbines", "the Olympic Games", "origami", "volunteering",
    "the theory of evolution", "mindfulness meditation", "the Great Depression", "self-driving cars", "fermentation",
    "the ozone layer", "classical mechanics", "language learning", "the Maya civilization", "fast fashion",
    "tidal energy", "universal basic income", "the human microbiome", "lighthouses", "hip-hop", "the Apollo program",
    "wildfires", "microfinance", "the scientific method", "tea ceremonies", "electric guitars", "sea turtles",
    "the Magna Carta", "cloud computing", "probability", "stage fright", "beekeeping", "dinosaurs", "cybersecurity",
    "the Enlightenment", "the Amazon river", "online privacy", "small businesses", "vertical farming", "comets",
    "the metric system", "board games", "monetary policy", "sign language", "the Vikings", "photography",
)
PERSONAS = (
    "a pirate captain", "a medieval knight", "a detective from the 1920s", "a friendly robot", "a grumpy chef",
    "a NASA flight director", "a kindergarten teacher", "a famous explorer", "a stand-up comedian", "a sports coach",
    "a wise old wizard", "a startup founder", "a tour guide in Rome", "a marine biologist", "a news anchor",
    "Sherlock Holmes", "a Victorian poet", "a park ranger", "a customer support agent", "a time traveler from 2300",
)
AUDIENCES = ("a ten-year-old", "a busy executive", "a first-year university student", "my grandmother",
             "a software engineer", "a group of tourists", "a high-school class", "someone who has never heard of it")
FORMATS = ("in three bullet points", "in one paragraph", "as a numbered list", "in under 50 words",
           "as a short table", "with an example", "step by step", "in a friendly tone", "in a formal tone", "")
OPEN = (
    "Write a blog post about {s}.", "Compose an engaging introduction to {s} {f}.", "Explain {s} to {a} {f}.",
    "What are the pros and cons of {s}?", "Write a poem about {s}.", "Write a short story in which {s} matters.",
    "Describe the history of {s} {f}.", "Why is {s} important? Answer {f}.", "Write a speech about {s} for {a}.",
    "What are common misconceptions about {s}?", "Give me a study plan to learn about {s} in two weeks.",
    "How does {s} affect everyday life?", "Write a product review related to {s}.", "Draft an email to {a} about {s}.",
    "Write a news headline and a short article about {s}.", "Explain the connection between {s} and {u}.",
    "Compare {s} with {u} {f}.", "Write a debate opening statement in favor of {s}.", "Summarize what experts say "
    "about {s} {f}.", "Give five tips related to {s}.", "Write a motivational message that mentions {s}.",
    "Describe a day in the life of someone who works with {s}.", "What questions remain open about {s}?",
    "Write a letter to the editor about {s}.", "Create a lesson plan on {s} for {a}.",
    "Write dialogue between two friends arguing about {s}.", "Invent a holiday that celebrates {s} and describe it.",
    "What would the world look like in 100 years because of {s}?", "Write a persuasive essay outline about {s}.",
    "Describe {s} using an analogy {f}.", "What ethical questions does {s} raise?",
)
ROLEPLAY = (
    "Pretend you are {p}. Tell me about {s}.", "You are {p}. Give advice to someone who is nervous about {s}.",
    "Act as {p} and describe your morning.", "Imagine you are {p}. What is your opinion of {s}?",
    "Stay in character as {p}. A visitor asks you how to get started with {s}. Reply.",
    "As {p}, write a short diary entry about a surprising day.",
)
NAMES = ("Ava", "Ben", "Carlos", "Dana", "Emeka", "Fatima", "George", "Hana", "Ivan", "Julia", "Kenji", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
ITEMS = (("apples", 0.5, 3), ("notebooks", 2, 6), ("tickets", 8, 40), ("cupcakes", 1.5, 4), ("books", 6, 25),
         ("plants", 4, 15), ("shirts", 10, 30), ("pencils", 0.25, 2), ("coffee beans (bags)", 7, 18),
         ("toy cars", 3, 12), ("eggs", 0.2, 0.6), ("movie tickets", 9, 15))
WORD_PROBLEMS = (
    "{n} buys {a} {i} at ${p} each and pays with a ${b} bill. How much change does {n} get?",
    "{n} has {a} {i}. {m} gives {n} {c} more, and then {n} sells {d} of them. How many {i} does {n} have now?",
    "A shop sells {i} for ${p} each. On Monday it sold {a} and on Tuesday {c} more than on Monday. How much money "
    "did it make on the two days?",
    "{n} saves ${c} every week. How many weeks does it take to save ${b}?",
    "{n} reads {c} pages a day. The book has {b} pages. After {d} days, how many pages are left?",
    "A train travels {c} miles per hour for {d} hours and then {a} miles per hour for {e} hours. How far does it go?",
    "{n} spent {pc}% of ${b} on {i} and the rest on rent. How much went to rent?",
    "{n} and {m} share {b} {i} in the ratio {d}:{e}. How many does each get?",
    "A recipe needs {d} cups of flour for {e} people. How much flour is needed for {c} people?",
    "{n} earns ${c} per hour and works {d} hours a day for {e} days. What is {n}'s total pay?",
)
MATH = (
    "Solve for x: {a}x + {c} = {b}.", "What is {pc}% of {b}?", "What is the area of a rectangle {a} by {c}?",
    "Find the mean of {a}, {b}, {c}, {d} and {e}.", "Is {b} a prime number? Explain.", "Simplify {a}/{c}.",
    "A triangle has sides {d}, {e} and {c}. Is it a right triangle?", "What is {a} squared minus {c} squared?",
    "Convert {b} minutes into hours and minutes.", "What is the probability of rolling a sum of {d} with two dice?",
    "The points ({d}, {e}) and ({a}, {c}) lie on a line. What is its slope?", "Factor x^2 + {s1}x + {p1}.",
)
PUZZLES = (
    "{n} is taller than {m}, and {m} is taller than {o}. Who is the shortest?",
    "If all {x} are {y} and some {y} are {z}, must some {x} be {z}? Explain.",
    "A farmer has {a} animals, some chickens and some cows, with {b} legs in total. How many of each?",
    "I have {c} coins, only quarters and dimes, worth ${d} in total. How many of each do I have?",
    "{n} is {a} years old. {m} is twice as old as {n} was {d} years ago. How old is {m}?",
    "Which is heavier: a kilogram of {i} or a kilogram of feathers? Explain your reasoning.",
    "If today is {day}, what day of the week will it be in {b} days?",
    "There are {a} people in a room and each shakes hands with every other person once. How many handshakes?",
)
KINDS = ("cats", "birds", "cars", "teachers", "musicians", "robots", "flowers", "engineers", "rivers", "painters")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
LANGS = ("Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust", "SQL", "Bash")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text file",
    "merges two sorted lists", "finds the longest common prefix of a list of strings", "computes Fibonacci numbers",
    "removes duplicates from a list while keeping order", "validates an email address",
    "parses a CSV file and prints the average of a column", "implements binary search",
    "finds the top {a} most frequent words in a text", "converts Celsius to Fahrenheit",
    "implements a stack with push and pop", "checks whether a string is a palindrome", "flattens a nested list",
    "computes the factorial of n iteratively", "sorts a list of dictionaries by a key", "implements bubble sort",
    "returns the n-th row of Pascal's triangle", "counts vowels in a sentence", "implements a simple LRU cache",
    "reads a JSON file and prints its keys", "finds the second largest number in an array",
    "rotates a matrix by 90 degrees", "computes the greatest common divisor of two numbers",
    "checks whether two strings are anagrams", "implements a queue using two stacks",
    "finds all pairs in an array that sum to {b}", "generates all permutations of a string",
)
CODE = (
    "Write a {l} function that {t}.", "Develop a {l} program that {t}.", "Show me {l} code that {t}, with comments.",
    "How would you write a {l} function that {t}? Explain the time complexity.",
    "Write a {l} function that {t}, and a few tests for it.",
)
CONCEPTS = ("a list and a tuple", "a process and a thread", "TCP and UDP", "a stack and a queue",
            "an interface and an abstract class", "recursion and iteration", "a compiler and an interpreter",
            "SQL and NoSQL databases", "unit tests and integration tests", "a hash table and a binary search tree",
            "pass by value and pass by reference", "static and dynamic typing", "a mutex and a semaphore")
CODE_OTHER = ("Explain the difference between {k} in {l}.", "When should a {l} programmer choose between {k}?",
              "Give a {l} example that shows the difference between {k}.")
# Short sentences in other languages to translate into English (and English ones to translate out), built from
# parts so the sentences are many.
DE = (("Der Lehrer", "Die Ärztin", "Mein Nachbar", "Die Regierung", "Das Unternehmen", "Meine Schwester"),
      ("hat gestern ein neues Haus gekauft", "besucht morgen die Stadt", "spricht oft mit den Kindern",
       "hat das Problem schnell gelöst", "veröffentlicht heute einen Bericht", "will die Preise erhöhen",
       "arbeitet am Wochenende im Park", "konnte den Zug nicht erreichen"))
FR = (("Le professeur", "La ville", "Mon ami", "Le gouvernement", "Cette entreprise"),
      ("a annoncé", "va construire", "a refusé", "prépare"),
      ("un nouveau projet", "une grande fête", "des changements importants", "un pont sur la rivière"))
ES = (("El niño", "La empresa", "Mi madre", "El equipo", "La universidad"),
      ("quiere", "ha comprado", "necesita", "va a abrir"),
      ("una casa nueva", "más tiempo", "un restaurante", "ayuda con el proyecto"))
EN_TARGETS = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese")
EN_SENTENCES = ("The weather is nice today.", "Where is the nearest train station?", "I would like a cup of coffee.",
                "Our meeting was moved to Thursday afternoon.", "The museum opens at nine in the morning.",
                "Can you help me find my keys?", "She has lived in this city for ten years.",
                "The results of the study surprised the scientists.")
COUNTRIES = ("France", "Japan", "Brazil", "Canada", "Kenya", "Australia", "India", "Egypt", "Mexico", "Norway",
             "Argentina", "Vietnam", "Italy", "Nigeria", "Sweden", "Peru", "Turkey", "Indonesia", "Poland", "Chile")
QA = (
    "What is the capital of {c}?", "What language is spoken in {c}?", "What currency does {c} use?",
    "Who invented {inv}?", "When did {ev} happen?", "Who wrote {bk}?", "What is {bk} about?",
    "What does a {job} do?", "Where is {lm} located?", "How old is {lm}?", "Who was the first president of {c}?",
    "What is the population of {c}, roughly?", "Which ocean or sea borders {c}?", "Why did {ev} matter?",
    "How does a {job} train for the job?", "Who is the main character of {bk}?", "What is {c} famous for?",
)
INVENTIONS = ("the telephone", "the light bulb", "the airplane", "the World Wide Web", "penicillin", "the radio",
              "the steam engine", "the printing press", "dynamite", "the telescope")
EVENTS = ("the fall of the Berlin Wall", "the first moon landing", "World War I", "the signing of the Magna Carta",
          "the invention of the printing press", "the French Revolution", "the first Olympic Games of modern times")
BOOKS = ("Pride and Prejudice", "1984", "Don Quixote", "Hamlet", "The Odyssey", "War and Peace", "Moby-Dick",
         "One Hundred Years of Solitude", "The Little Prince", "Frankenstein")
JOBS = ("radiologist", "actuary", "sommelier", "civil engineer", "paralegal", "data scientist", "pharmacist")
LANDMARKS = ("the Eiffel Tower", "Machu Picchu", "the Taj Mahal", "the Great Barrier Reef", "Mount Kilimanjaro",
             "the Colosseum", "Angkor Wat", "the Golden Gate Bridge")
READING = (
    "Summarize: {doc}", "Summarize the following text in a few sentences.\n\n{doc}",
    "{doc}\n\nWhat is the main point of the text above?", "Extract the key facts from this text as a list:\n{doc}",
    "Read the passages below and answer the question.\n\n{doc}\n\nQuestion: What do the passages say about {s}?",
    "{doc}\n\nWrite a title for this text and explain your choice.",
    "Rewrite the following text for {a}:\n\n{doc}", "List three questions that this text answers:\n{doc}",
    "Evaluate the following text on a scale of 1 to 5 for clarity, and explain:\n{doc}",
    "Based on the documents below, {s_q}\n\n{doc}",
)
FOLLOW_UPS = ("Can you make it shorter?", "Now explain it in more detail.", "Give me an example.",
              "Rewrite your previous answer in a more formal style.", "Can you put that in a list?",
              "What is the most important point?", "Now do the same for {u}.", "Translate your answer into French.")


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _slots(rng: np.random.Generator) -> dict:
    """One set of fillers shared by a prompt's template: numbers sized like everyday word problems."""
    item, lo, hi = _pick(rng, ITEMS)
    a, c, d, e = (int(rng.integers(lo_, hi_)) for lo_, hi_ in ((2, 20), (2, 60), (2, 9), (2, 9)))
    r1, r2 = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    s, u = rng.choice(len(SUBJECTS), size=2, replace=False)
    n, m, o = rng.choice(len(NAMES), size=3, replace=False)
    return dict(
        s=SUBJECTS[s], u=SUBJECTS[u], a=a, b=int(rng.integers(60, 1000)), c=c, d=d, e=e, f=_pick(rng, FORMATS),
        p=round(float(rng.uniform(lo, hi)), 2), i=item, n=NAMES[n], m=NAMES[m], o=NAMES[o],
        pc=int(_pick(rng, (5, 10, 15, 20, 25, 30, 40, 50, 75))), s1=r1 + r2, p1=r1 * r2,
        x=_pick(rng, KINDS), y=_pick(rng, KINDS), z=_pick(rng, KINDS), day=_pick(rng, DAYS),
        l=_pick(rng, LANGS), c_=_pick(rng, COUNTRIES), p_=_pick(rng, PERSONAS), a_=_pick(rng, AUDIENCES),
    )


def _sentence(rng: np.random.Generator, parts) -> str:
    return " ".join(_pick(rng, p) for p in parts) + "."


def _one(rng: np.random.Generator, family: str, documents: list[str]) -> str:
    v = _slots(rng)
    if family == "open":
        return _pick(rng, OPEN).format(s=v["s"], u=v["u"], a=v["a_"], f=v["f"]).replace(" .", ".")
    if family == "roleplay":
        return _pick(rng, ROLEPLAY).format(p=v["p_"], s=v["s"])
    if family == "word_problem":
        return _pick(rng, WORD_PROBLEMS).format(**{**v, "b": max(v["b"], v["a"] * 20)})
    if family == "math":
        return _pick(rng, MATH).format(**v)
    if family == "puzzle":
        return _pick(rng, PUZZLES).format(**v)
    if family == "code":
        if rng.random() < 0.2:
            return _pick(rng, CODE_OTHER).format(k=_pick(rng, CONCEPTS), l=v["l"])
        return _pick(rng, CODE).format(l=v["l"], t=_pick(rng, CODE_TASKS).format(a=v["d"], b=v["c"]))
    if family == "translation":
        which = rng.random()
        if which < 0.4:
            return "Translate German to English: " + _sentence(rng, DE)
        if which < 0.55:
            return "Translate French to English: " + _sentence(rng, FR)
        if which < 0.7:
            return "Translate Spanish to English: " + _sentence(rng, ES)
        return f"Translate into {_pick(rng, EN_TARGETS)}: {_pick(rng, EN_SENTENCES)}"
    if family == "qa":
        return _pick(rng, QA).format(c=v["c_"], inv=_pick(rng, INVENTIONS), ev=_pick(rng, EVENTS),
                                     bk=_pick(rng, BOOKS), job=_pick(rng, JOBS), lm=_pick(rng, LANDMARKS))
    if family == "reading":
        n_docs = int(rng.integers(1, 5))  # one document, or several as retrieved passages
        picked = [documents[int(j)] for j in rng.choice(len(documents), size=min(n_docs, len(documents)),
                                                         replace=False)]
        doc = "\n\n".join(picked)
        return _pick(rng, READING).format(doc=doc, s=v["s"], a=v["a_"],
                                          s_q=_pick(rng, ("what are the main claims?", "which facts are mentioned?",
                                                          f"how does it relate to {v['u']}?")))
    raise ValueError(family)


# Shares of the families (reading only where documents are given); writing-like tasks dominate chat use.
FAMILY_WEIGHTS = {"open": 0.30, "roleplay": 0.06, "word_problem": 0.09, "math": 0.06, "puzzle": 0.06,
                  "code": 0.12, "translation": 0.07, "qa": 0.08, "reading": 0.16}
FOLLOW_UP_SHARE = 0.12  # conversations with a second user turn after an assistant answer


def broad_prompts(n: int, seed: int = 0, documents: list[str] | tuple = ()) -> list[list[dict]]:
    """`n` chat conversations ending in a user turn, drawn from every family (reading ones need `documents`)."""
    rng = np.random.default_rng(seed)
    families = [f for f in FAMILY_WEIGHTS if f != "reading" or documents]
    weights = np.asarray([FAMILY_WEIGHTS[f] for f in families])
    weights = weights / weights.sum()
    out = []
    for _ in range(n):
        family = families[int(rng.choice(len(families), p=weights))]
        text = _one(rng, family, list(documents))
        if rng.random() < FOLLOW_UP_SHARE:
            first = _one(rng, family, list(documents))
            answer = documents[int(rng.integers(len(documents)))] if documents else "Sure, here is my answer."
            follow = _pick(rng, FOLLOW_UPS).format(u=_pick(rng, SUBJECTS))
            out.append([{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": follow}])
        else:
            out.append([{"role": "user", "content": text}])
    return out
