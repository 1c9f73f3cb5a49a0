"""Training prompts made on this machine, with no network and no evaluation data.

The built-in dataset (``--dataset builtin``) is what the default drafter is trained on. It never
reads the MT-Bench questions (the evaluation set, ``eval_sets.MT_BENCH``). Its sources:

1. Templated instructions: task templates across common assistant uses (writing, role play,
   reasoning, arithmetic, coding, extraction, science, humanities) filled from topic lists and
   random numbers (:func:`templated_prompts`).
2. English text shipped with installed packages: Python standard-library docstrings and the
   licence files in ``site-packages``, used as material for summarise / explain / rewrite
   requests (:func:`local_paragraphs`).
3. Self-instruct: the target itself writes user questions about a topic, for several kinds of
   task (questions, requests, creative writing, role play, math word problems, reasoning,
   programming, humanities; :func:`self_instruct_requests`), sampled reproducibly; they are then
   answered like the others.
4. Documents: small synthetic records (people, products, reviews, reports, schedules) and local
   paragraphs, each with a request to extract, tabulate, classify or answer from it, often in a
   set format such as JSON (:func:`document_prompts`): the answers copy from their context.
5. Constrained requests: several instructions at once (form, audience, tone, length, a closing
   line) and multi-part questions (:func:`constrained_prompts`).

The responses to all of them are generated greedily by the target (``labels=self``), so every
response position carries the target's own continuation, i.e. a distillation label.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import random
import re
import warnings

TOPICS = [
    "climate change", "the history of the printing press", "healthy sleep habits", "learning a new language",
    "remote work", "electric cars", "the water cycle", "photosynthesis", "volcanoes", "the Roman Empire",
    "the French Revolution", "machine learning", "personal finance", "saving for retirement", "public speaking",
    "time management", "gardening", "baking bread", "coffee", "tea ceremonies", "chess", "football",
    "the Olympic Games", "jazz music", "classical music", "painting", "photography", "urban planning",
    "public transport", "renewable energy", "solar panels", "the internet", "social media", "smartphones",
    "video games", "space exploration", "the Moon landing", "black holes", "the human brain", "vaccines",
    "nutrition", "running a marathon", "yoga", "meditation", "friendship", "job interviews", "writing a CV",
    "starting a small business", "marketing", "negotiation", "leadership", "teamwork", "recycling",
    "ocean pollution", "rainforests", "honey bees", "dogs as pets", "cats", "bird migration", "dinosaurs",
    "ancient Egypt", "the Renaissance", "the Industrial Revolution", "democracy", "human rights",
    "the stock market", "inflation", "cryptocurrencies", "cybersecurity", "passwords", "cloud computing",
    "open source software", "databases", "the history of computers", "robots", "artificial intelligence ethics",
    "travelling on a budget", "visiting Japan", "Italian cuisine", "vegetarian cooking", "camping",
    "mountain climbing", "architecture", "museums", "libraries", "reading habits", "poetry", "mythology",
    "philosophy of mind", "stoicism", "happiness", "parenting", "education reform", "online learning",
    "mathematics in daily life", "probability", "prime numbers", "geometry", "statistics", "chemistry",
    "the periodic table", "magnetism", "electricity", "the speed of light", "gravity", "evolution", "genetics",
    "the immune system", "the heart", "weather forecasting", "earthquakes", "deserts", "the Arctic",
    "coral reefs", "wind power", "nuclear energy", "water conservation", "city life", "rural life",
    "volunteering", "a birthday party", "moving to a new city", "a rainy day", "a lost key", "a robot chef",
]
ROLES = [
    "pirate captain", "medieval knight", "detective", "astronaut", "chef", "teacher", "doctor",
    "tour guide", "librarian", "software engineer", "farmer", "museum curator", "sports coach",
    "news reporter", "wizard", "time traveller", "park ranger", "barista", "mountain guide",
]
PEOPLE = ["Alice", "Bob", "Maria", "Ken", "Priya", "Omar", "Lena", "Tom", "Sara", "Yuki"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "removes duplicates from a list while keeping order",
    "merges two sorted lists", "computes the factorial of a number", "finds the largest element of a list",
    "checks whether a string is a palindrome", "reads a CSV file and sums a column",
    "converts Celsius to Fahrenheit", "flattens a nested list", "computes the median of a list",
    "counts how often each character occurs in a string", "validates an email address with a regex",
    "sorts a list of dictionaries by a key", "implements binary search", "computes the GCD of two numbers",
    "generates all permutations of a list", "parses a date string", "finds the longest common prefix",
    "implements a stack class", "implements a queue with two stacks", "transposes a matrix",
    "checks whether brackets in a string are balanced", "converts a number to Roman numerals",
]
LANGUAGES = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash"]

TEMPLATES = {
    "writing": [
        "Write a short blog post about {topic}.", "Write a persuasive paragraph about {topic}.",
        "Compose a short poem about {topic}.", "Write a short story that involves {topic}.",
        "Draft a polite email to a colleague about {topic}.", "Write a product description related to {topic}.",
        "Write a speech for a school event about {topic}.", "Give me a catchy title and an outline for an article on {topic}.",
    ],
    "roleplay": [
        "Pretend you are a {role}. Describe your typical day.",
        "You are a {role}. Explain {topic} to a group of children.",
        "Act as a {role} and give advice to someone who is nervous about {topic}.",
        "Imagine you are a {role} writing a diary entry about {topic}.",
    ],
    "reasoning": [
        "{person} is older than {person2}, and {person2} is older than {person3}. Who is the youngest? Explain your reasoning.",
        "A train travels {a} km in {b} hours. What is its average speed? Explain step by step.",
        "{person} has {a} apples and gives {b} of them to {person2}. How many apples does {person} have left?",
        "If all bloops are razzies and some razzies are lazzies, are some bloops necessarily lazzies? Explain.",
        "What are the pros and cons of {topic}? Think it through step by step.",
    ],
    "math": [
        "Solve for x: {a}x + {b} = {c}.", "What is the sum of the integers from 1 to {n}?",
        "Compute {a} times {b} and show your work.", "What is the area of a rectangle with sides {a} cm and {b} cm?",
        "A shop gives a {p}% discount on a {c} dollar item. What is the final price?",
        "What is the probability of rolling a total of {d} with two fair dice?",
        "Is {n} a prime number? Explain.", "Convert {n} to binary and explain the method.",
    ],
    "coding": [
        "Write a Python function that {task}.", "How do I write a program that {task} in {lang}?",
        "Write a function in {lang} that {task}, with comments.",
        "Explain the time complexity of a function that {task}.",
        "What is the difference between a list and a tuple in Python?",
        "Explain what a {concept} is in programming, with an example in {lang}.",
    ],
    "stem": [
        "Explain {topic} in simple terms.", "What are three surprising facts about {topic}?",
        "How does {topic} affect everyday life?", "Describe the science behind {topic}.",
        "What are the main differences between {topic} and {topic2}?",
    ],
    "humanities": [
        "Discuss the historical significance of {topic}.", "What can we learn from {topic}?",
        "Give a balanced overview of the debate around {topic}.",
        "How has {topic} changed over the last hundred years?",
        "Write a short essay comparing {topic} and {topic2}.",
    ],
}
CONCEPTS = ["closure", "recursion", "hash map", "linked list", "class", "generator", "decorator",
            "pointer", "thread", "unit test", "API", "regular expression", "binary tree", "interface"]
TEXT_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{text}",
    "Extract the key points from this text as a bulleted list:\n\n{text}",
    "Explain the following in simple words:\n\n{text}",
    "Rewrite the following text in a friendlier tone:\n\n{text}",
    "What questions could a student ask about this text?\n\n{text}",
]
SELF_INSTRUCT = [
    "Write one question that a curious person might ask an AI assistant about {topic}. Reply with the question only.",
    "Write a request that someone could give an AI assistant, about {topic}. Reply with the request only.",
    "Write a short homework question about {topic}. Reply with the question only.",
    "Write a creative writing request about {topic} that someone could give an AI assistant. Reply with the request only.",
    "Write a request asking an AI assistant to play a {role} and talk about {topic}. Reply with the request only.",
    "Write a math word problem about {topic}. Reply with the problem only.",
    "Write a question about {topic} that needs careful step-by-step reasoning. Reply with the question only.",
    "Write a programming task in {lang} that has to do with {topic}. Reply with the task only.",
    "Write a question a student of history or philosophy might ask about {topic}. Reply with the question only.",
]
STDLIB_MODULES = [
    "json", "os", "re", "collections", "itertools", "functools", "string", "textwrap", "datetime", "math",
    "statistics", "random", "pathlib", "shutil", "csv", "argparse", "logging", "typing", "dataclasses",
    "enum", "heapq", "bisect", "decimal", "fractions", "hashlib", "base64", "uuid", "urllib.parse", "html",
    "zipfile", "tarfile", "gzip", "sqlite3", "unittest", "difflib", "calendar", "copy", "pprint", "inspect",
    "operator", "contextlib", "abc", "threading", "queue", "configparser", "tempfile", "glob", "fnmatch",
    "io", "struct", "weakref", "time", "shlex", "codecs", "email.message", "http.client", "socket",
    "subprocess", "asyncio", "concurrent.futures", "pickle", "sched", "secrets", "smtplib", "traceback",
    "warnings", "xml.etree.ElementTree",
]


def templated_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct-as-possible templated prompts, reproducible from ``seed``."""
    rng = random.Random(seed)
    categories = sorted(TEMPLATES)
    prompts: list[str] = []
    seen: set[str] = set()
    for _ in range(n * 20):
        if len(prompts) == n:
            break
        template = rng.choice(TEMPLATES[categories[len(prompts) % len(categories)]])
        prompt = template.format(**_slots(rng))
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def _slots(rng: random.Random) -> dict[str, object]:
    person, person2, person3 = rng.sample(PEOPLE, 3)
    topic, topic2 = rng.sample(TOPICS, 2)
    a, b = rng.randint(2, 99), rng.randint(2, 40)
    return dict(topic=topic, topic2=topic2, role=rng.choice(ROLES), person=person, person2=person2,
                person3=person3, a=a, b=b, c=rng.randint(a, 400), n=rng.randint(5, 300),
                p=rng.choice([5, 10, 15, 20, 25, 30, 40, 50]), d=rng.randint(2, 12),
                task=rng.choice(CODE_TASKS), lang=rng.choice(LANGUAGES), concept=rng.choice(CONCEPTS))


def local_paragraphs(max_paragraphs: int, seed: int, min_chars: int = 120,
                     max_chars: int = 900) -> list[str]:
    """English paragraphs from installed packages: stdlib docstrings, then licence files."""
    paragraphs = _stdlib_paragraphs(min_chars, max_chars) + _licence_paragraphs(min_chars, max_chars)
    unique = sorted(set(paragraphs))
    random.Random(seed).shuffle(unique)
    return unique[:max_paragraphs]


def _split_paragraphs(text: str, min_chars: int, max_chars: int) -> list[str]:
    parts = [re.sub(r"[ \t]+", " ", p.strip()) for p in re.split(r"\n\s*\n", text)]
    return [p for p in parts if min_chars <= len(p) <= max_chars and sum(c.isalpha() for c in p) > len(p) // 2]


def _stdlib_paragraphs(min_chars: int, max_chars: int) -> list[str]:
    out: list[str] = []
    for name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # a stdlib module missing on this build: skip it
            continue
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr, None)
            if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            out.extend(_split_paragraphs(doc, min_chars, max_chars))
    return out


def _licence_paragraphs(min_chars: int, max_chars: int) -> list[str]:
    out: list[str] = []
    for dist in importlib.metadata.distributions():
        for file in dist.files or []:
            if re.search(r"(LICEN[CS]E|COPYING)[^/]*$", file.name, re.IGNORECASE):
                try:
                    text = file.read_text()
                except (OSError, UnicodeDecodeError, FileNotFoundError):
                    continue
                out.extend(_split_paragraphs(text or "", min_chars, max_chars))
    return out


def text_prompts(n: int, seed: int) -> list[str]:
    """Summarise / explain / rewrite requests over local paragraphs."""
    rng = random.Random(seed + 1)
    paragraphs = local_paragraphs(n, seed)
    return [rng.choice(TEXT_TEMPLATES).format(text=p) for p in paragraphs]


def self_instruct_requests(n: int, seed: int) -> list[str]:
    """Meta-prompts asking the target to write a user question (answers become prompts)."""
    rng = random.Random(seed + 2)
    return [rng.choice(SELF_INSTRUCT).format(topic=rng.choice(TOPICS), role=rng.choice(ROLES),
                                             lang=rng.choice(LANGUAGES)) for _ in range(n)]


SURNAMES = ["Smith", "Garcia", "Chen", "Okafor", "Novak", "Kumar", "Rossi", "Tanaka", "Dubois",
            "Silva", "Larsen", "Haddad"]
CITIES = ["Lisbon", "Toronto", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Dublin", "Seoul",
          "Melbourne", "Cairo", "Oslo"]
PRODUCTS = ["wireless headphones", "a coffee grinder", "a standing desk", "a hiking backpack",
            "an electric kettle", "a smartwatch", "a robot vacuum", "a camping tent", "a blender",
            "a pair of running shoes", "a laptop stand", "a reading lamp"]
OPINIONS = {
    "positive": ["works perfectly and I use it every day", "exceeded my expectations",
                 "is well made and worth the price", "arrived early and looks great"],
    "negative": ["broke after two weeks", "is much louder than advertised",
                 "stopped charging after a month", "feels cheap and flimsy"],
    "neutral": ["does the job, nothing special", "is fine but the manual is confusing",
                "is okay for the price", "is as described, no surprises"],
}
DOCUMENT_TASKS = {
    "people": [
        "From the text below, extract each person's name, age and city as a JSON list of objects.",
        "Who is the oldest person in the text below, and where do they live? Answer from the text only.",
        "Turn the text below into a table with the columns Name, Age, City and Job.",
    ],
    "reviews": [
        "Classify each review below as positive, negative or neutral. Answer with one line per review.",
        "Summarize the reviews below in three bullet points: what customers like and dislike.",
        "Return the reviews below as JSON: a list of objects with the keys product, rating and sentiment.",
    ],
    "report": [
        "From the report below, extract the company name, the revenue, the growth and the CEO as JSON.",
        "Based only on the report below, did the company do better than last year? Explain briefly.",
        "Write a two-sentence news headline and lead for the report below.",
    ],
    "schedule": [
        "List the events below in chronological order with their times.",
        "Extract every date, time and place from the text below as a table.",
        "Which events below happen in the afternoon? Answer with a bulleted list.",
    ],
    "paragraph": [
        "Identify the three most important terms in the text below and explain each in one sentence.",
        "Extract every named function, class or object mentioned in the text below as a JSON list.",
        "Answer in one sentence, using only the text below: what is it describing?",
        "Write three quiz questions with answers based on the text below.",
    ],
}
FORMS = ["an email", "a tweet", "a haiku", "a limerick", "a short dialogue", "a travel itinerary",
         "a lesson plan", "a product pitch", "a motivational speech", "a news article", "a recipe",
         "a letter of recommendation", "a to-do list", "a FAQ section", "a social media post"]
AUDIENCES = ["a five-year-old", "a busy manager", "a group of university students", "a grandparent",
             "a beginner", "an expert", "a job interviewer", "a teenager"]
TONES = ["humorous", "formal", "friendly", "enthusiastic", "serious", "poetic", "sarcastic", "calm"]
CONSTRAINTS = ["in exactly three sentences", "in under 100 words", "using bullet points",
               "with a title", "in five numbered steps", "ending with a question to the reader",
               "including at least one statistic", "mentioning {person} by name",
               "in the first person", "without using any technical terms"]
MULTI_PART = [
    "First explain what {topic} is, then give two real-world examples, and finally list one common misconception.",
    "Compare {topic} and {topic2} in a table, then say which one you would recommend to {audience} and why.",
    "Give me a three-day plan for learning about {topic}, with one activity per day and a short quiz at the end.",
    "What are the causes, effects and possible solutions of problems related to {topic}? Use three headings.",
    "{person} wants to get into {topic} but has only {a} minutes a day. Suggest a routine and explain your choices.",
    "Describe {topic} from the point of view of a {role}, then rewrite the description for {audience}.",
]


def document_prompts(n: int, seed: int) -> list[str]:
    """Extract / tabulate / classify / answer requests over small documents (see the module doc)."""
    rng = random.Random(seed + 3)
    paragraphs = local_paragraphs(n, seed + 3)
    prompts = []
    for i in range(n):
        kind = ("people", "reviews", "report", "schedule", "paragraph")[i % 5]
        text = (paragraphs[i % len(paragraphs)] if kind == "paragraph" and paragraphs
                else _document(kind if kind != "paragraph" else "people", rng))
        prompts.append(f"{rng.choice(DOCUMENT_TASKS[kind])}\n\n{text}")
    return prompts


def _document(kind: str, rng: random.Random) -> str:
    """A small synthetic record of ``kind``: names, numbers and places drawn from ``rng``."""
    if kind == "people":
        rows = []
        for first in rng.sample(PEOPLE, rng.randint(3, 5)):
            rows.append(f"{first} {rng.choice(SURNAMES)} is {rng.randint(19, 78)} years old, lives in "
                        f"{rng.choice(CITIES)} and works as {_a(rng.choice(ROLES))}.")
        return " ".join(rows)
    if kind == "reviews":
        lines = []
        for k in range(rng.randint(3, 5)):
            sentiment = rng.choice(sorted(OPINIONS))
            stars = {"positive": rng.randint(4, 5), "negative": rng.randint(1, 2), "neutral": 3}[sentiment]
            lines.append(f"Review {k + 1} ({stars} stars): The {rng.choice(PRODUCTS).split(' ', 1)[-1]} "
                         f"{rng.choice(OPINIONS[sentiment])}.")
        return "\n".join(lines)
    if kind == "report":
        year, revenue, growth = rng.randint(2015, 2024), rng.randint(12, 900), rng.randint(-15, 40)
        return (f"{rng.choice(SURNAMES)} {rng.choice(['Labs', 'Foods', 'Energy', 'Motors', 'Media'])} "
                f"reported revenue of ${revenue} million in {year}, a change of {growth}% from "
                f"{year - 1}. Its CEO, {rng.choice(PEOPLE)} {rng.choice(SURNAMES)}, said the results "
                f"were driven by {rng.choice(TOPICS)}. The company employs {rng.randint(40, 9000)} "
                f"people and is based in {rng.choice(CITIES)}.")
    events = []
    for topic in rng.sample(TOPICS, rng.randint(3, 5)):
        events.append(f"A talk on {topic} at {rng.randint(8, 19)}:{rng.choice(['00', '15', '30', '45'])} "
                      f"on {rng.choice(['Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday'])} "
                      f"in {rng.choice(CITIES)}, led by {rng.choice(PEOPLE)}.")
    return " ".join(events)


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def constrained_prompts(n: int, seed: int) -> list[str]:
    """Requests with several instructions at once, and multi-part questions."""
    rng = random.Random(seed + 4)
    prompts = []
    for i in range(n):
        slots = {**_slots(rng), "audience": rng.choice(AUDIENCES)}
        if i % 3 == 2:
            prompts.append(rng.choice(MULTI_PART).format(**slots))
            continue
        first, second = rng.sample(CONSTRAINTS, 2)
        prompts.append(f"Write {rng.choice(FORMS)} about {slots['topic']} for {slots['audience']}, "
                       f"in a {rng.choice(TONES)} tone, {first.format(**slots)} and "
                       f"{second.format(**slots)}.")
    return prompts


def clean_self_instruct(text: str) -> str | None:
    """The question in the target's answer to a self-instruct request, or None if unusable."""
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    line = re.sub(r"^(question|request|q)\s*[:.]\s*", "", line, flags=re.IGNORECASE).strip(" \"'*")
    return line if 15 <= len(line) <= 400 else None
