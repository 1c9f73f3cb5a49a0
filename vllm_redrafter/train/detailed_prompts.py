"""Detailed requests: long, specific, several requirements each, the way people ask an assistant.

The built-in dataset's source ``detailed``: ``detailed_prompts(n, seed)`` gives ``n`` distinct
requests, the eight kinds of task MT-Bench groups its questions into in turn, reproducible from
``seed``. Each is built from a subject with its own details (a trip to a named place, a product
with a feature, a character in a situation, a data set with numbers), an angle and one or two
requirements; the wording is this module's own (``tests/test_train.py`` checks that no six-word
window of an MT-Bench question appears).

Why such requests, and what they gave: docs/training.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from vllm_redrafter.train.prompts import CITIES, LANGUAGES, PEOPLE, SURNAMES, TOPICS, _a, _document

PLACES = ["Kyoto", "Iceland", "the Scottish Highlands", "Patagonia", "Marrakech", "Vietnam",
          "New Zealand", "the Amalfi Coast", "Cape Town", "Quebec City", "Istanbul", "Peru",
          "the Norwegian fjords", "Bali", "Costa Rica", "Vienna", "the Greek islands", "Mexico City"]
ANGLES = ["who loves food markets", "who is interested in old buildings", "on a tight budget",
          "who cannot walk far", "travelling with two young children", "who likes quiet places",
          "who wants to take good photographs"]
WRITING = [
    "Plan a one-day walking route through {place} for a visitor {angle}, with times and one "
    "place to eat.",
    "Draft a cover letter for {person}, who is applying for a job as {a_role} at a company that "
    "works on {topic}. Mention two relevant achievements and keep it under 250 words.",
    "Write the opening paragraph of a mystery story set in {city}, in which {person} finds {object} "
    "that should not be there.",
    "Compose a heartfelt speech for {person}'s retirement party; {person} worked for {n} years as "
    "{a_role}. Include one funny anecdote.",
    "Write a persuasive op-ed arguing that every town should invest in {topic}. Address the "
    "strongest objection before you conclude.",
    "Write an announcement for the launch of {product}, a new product whose main feature is "
    "{feature}. Aim it at {audience} and end with a call to action.",
    "Write a short poem in which {object} describes {topic}, with a rhyme in every second line.",
    "Rewrite this sentence to be more vivid and concise, then explain what you changed: "
    "\"{sentence}\"",
    "Write a restaurant review of a small {cuisine} place in {city}: the service, two dishes and "
    "the atmosphere, with a rating out of five.",
    "Draft an email to your landlord about {problem}. Be polite but firm and propose a deadline.",
]
ROLEPLAY = [
    "Imagine you are {character}. {situation} Describe what you do next and why.",
    "Pretend to be {character} and answer this question from a visitor: \"{question}\"",
    "You are {character}. Write a letter to your younger self about {topic}.",
    "Act as {a_role} giving a first lesson to {audience}. Start by introducing yourself, then explain "
    "{topic} with an everyday example.",
    "Role-play a job interview: you are the interviewer for a {role} position and I am {person}. Ask "
    "your first three questions and explain what each one tests.",
    "Stay in character as {character} and convince a skeptical town council to fund {topic}.",
]
CHARACTERS = ["a ship's captain in the 1800s", "a detective in 1920s London", "a medieval "
              "blacksmith", "a robot that has just learned to feel emotions", "a dragon guarding a "
              "library", "the first person to live on Mars", "a tired barista on a Monday morning",
              "a wizard who has lost their spellbook", "a park ranger in Yellowstone", "a time "
              "traveller from the year 2300", "a famous chef judging a cooking contest", "a cat "
              "who runs a bookshop"]
SITUATIONS = ["A storm is coming and the crew is frightened.", "Someone has stolen the most "
              "valuable thing you own.", "A stranger asks you for help finding their way home.",
              "You have one hour to prepare a meal for a king.", "The power goes out across the "
              "whole city.", "You discover a door you have never seen before."]
REASONING = [
    "{p1}, {p2}, {p3} and {p4} sit in a row. {p1} is not at either end, {p2} sits to the right of "
    "{p3}, and {p4} sits at the left end. Who sits where? Explain each step.",
    "{person} has {a} coins, some worth 5 cents and some worth 10 cents, {b} cents in total. How "
    "many of each does {person} have? Show your reasoning.",
    "A farmer has {a} animals, chickens and cows, with {legs} legs in total. How many of each are "
    "there? Solve it two different ways.",
    "If it takes {a} machines {a} minutes to make {a} widgets, how long would it take {b} machines "
    "to make {b} widgets? Explain.",
    "Is this argument valid: \"All {group} like {topic}. {person} likes {topic}. So {person} is "
    "one of the {group}.\"? Explain why or why not.",
]
MATH = [
    "Solve the system of equations {a}x + {b}y = {c} and {d}x - y = {e}, and check your answer.",
    "A store raises a price by {p}% and later lowers the new price by {p}%. Is the final price "
    "higher or lower than the original, and by how much?",
    "A bag has {a} red, {b} blue and {c} green marbles. If you draw two without replacement, what "
    "is the probability that both are the same color?",
    "Find all integer solutions of |x - {a}| < {b}, and say how many there are.",
    "{person} invests {money} dollars at {p}% interest compounded yearly. How much will there be "
    "after {n} years? Show each year's amount.",
    "The sum of three consecutive even numbers is {s6}. What are the numbers? Explain.",
    "Prove that the sum of the first n odd numbers is n squared, and check it for n = {n}.",
]
CODING = [
    "Write a {lang} function that {task}. Do not use any library function that does it for you, "
    "and explain its time complexity.",
    "Implement {algorithm} in {lang}, with comments, and give an example input and output.",
    "Here is a {lang} snippet that is supposed to {task} but has a bug:\n\n{snippet}\n\nFind the "
    "bug, fix it and explain what went wrong.",
    "Write a program in {lang} that reads a CSV file of {records} and prints {report}.",
    "Design a simple class for {thing} in {lang}, with methods to {m1} and {m2}.",
    "What is the difference between {c1} and {c2}? Give a short example of each in {lang}.",
    "Write a SQL query that finds {sql_goal} in a table {table}.",
    "Write unit tests for a function that {task}, covering the edge cases you can think of.",
]
ALGORITHMS = ["binary search", "merge sort", "quicksort", "breadth-first search on a graph",
              "Dijkstra's shortest path", "a stack using two queues", "an LRU cache", "the "
              "longest common subsequence", "a trie for autocomplete", "run-length encoding",
              "the Sieve of Eratosthenes", "a function to balance parentheses"]
CODE_TASKS = ["reverses the words in a sentence", "finds the second largest number in a list",
              "checks whether a string is a palindrome, ignoring punctuation", "merges two sorted "
              "lists", "counts how often each word appears in a text", "removes duplicates from a list while keeping the order",
              "converts a Roman numeral to an integer", "returns the n-th Fibonacci number",
              "groups a list of words into anagrams"]
EXTRACTION = [
    "From the text below, extract every person, the city they live in and their job, and return "
    "them as a JSON list.\n\n{people}",
    "Read these product reviews and summarize what buyers liked and what they complained about, "
    "in two short lists.\n\n{reviews}",
    "Identify the company, its revenue, the year and the person quoted in this report, and "
    "present them as a table.\n\n{report}",
    "Here are monthly sales figures: {sales}. Which month was best and which was worst? Give the "
    "total and the average, and return the answer in JSON.",
    "Sort the following events by time and say which ones overlap:\n\n{events}",
    "Extract all dates and amounts of money from this email and list them with what each refers "
    "to:\n\n{email}",
]
STEM = [
    "Explain how {phenomenon} works, and describe one experiment a student could do at home to "
    "observe it.",
    "What would happen to {system} if {change}? Explain the science step by step.",
    "A {obj} of mass {a} kg moves at {b} m/s. What is its kinetic energy, and how would it change "
    "if the speed doubled?",
    "Describe the process of {process} and explain why it matters for {domain}.",
    "Compare {tech1} and {tech2}: how each works, their costs, and where each is the better "
    "choice.",
    "Explain {phenomenon} to {audience}, then give the more precise explanation a scientist would "
    "give.",
]
PHENOMENA = ["the greenhouse effect", "superconductivity", "tides",
             "the Doppler effect", "nuclear fusion", "antibiotic resistance", "plate tectonics",
             "how batteries store energy", "the immune response", "how GPS finds your position",
             "black holes", "how a refrigerator cools", "rainbows", "echolocation in bats"]
HUMANITIES = [
    "How did {event} change {domain}? Discuss both short-term and long-term effects.",
    "Compare the ideas of {thinker1} and {thinker2} about {theme}. Where do they agree?",
    "Discuss whether {claim}. Present arguments on both sides and give your own view.",
    "Explain the main themes of {work} and why it is still read today.",
    "Write a short lesson plan that teaches {event} to high school students, with one activity.",
]
EVENTS = ["the invention of the printing press", "the Industrial Revolution", "the fall of the "
          "Roman Empire", "the Renaissance", "the moon landing", "the spread of the internet",
          "the French Revolution", "the abolition of slavery", "the Silk Road trade"]
THINKERS = ["Plato", "Aristotle", "Confucius", "Kant", "John Stuart Mill", "Simone de Beauvoir",
            "Adam Smith", "Karl Marx", "Hannah Arendt", "Nietzsche"]


def detailed_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct detailed requests, the eight kinds in turn, reproducible from ``seed``."""
    return draw_in_turn(list(_KINDS.values()), n, random.Random(seed + 5))


def draw_in_turn(kinds: list[Callable[[random.Random], str]], n: int,
                 rng: random.Random) -> list[str]:
    """Up to ``n`` distinct prompts, one kind after another (a repeat is drawn again)."""
    prompts: list[str] = []
    seen: set[str] = set()
    for _ in range(20 * n):
        if len(prompts) == n:
            break
        prompt = kinds[len(prompts) % len(kinds)](rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def _pick(rng: random.Random, templates: list[str], **slots: object) -> str:
    return rng.choice(templates).format(**slots)


def _writing(rng: random.Random) -> str:
    return _pick(rng, WRITING, place=rng.choice(PLACES), angle=rng.choice(ANGLES),
                 person=_name(rng), a_role=_a(rng.choice(JOBS)), topic=rng.choice(TOPICS),
                 city=rng.choice(CITIES), object=rng.choice(OBJECTS), n=rng.randint(12, 40),
                 product=rng.choice(PRODUCT_NAMES), feature=rng.choice(FEATURES),
                 audience=rng.choice(AUDIENCES), sentence=rng.choice(SENTENCES),
                 cuisine=rng.choice(CUISINES), problem=rng.choice(PROBLEMS))


def _roleplay(rng: random.Random) -> str:
    return _pick(rng, ROLEPLAY, character=rng.choice(CHARACTERS), situation=rng.choice(SITUATIONS),
                 question=rng.choice(VISITOR_QUESTIONS), topic=rng.choice(TOPICS),
                 a_role=_a(rng.choice(JOBS)), role=rng.choice(JOBS), audience=rng.choice(AUDIENCES),
                 person=_name(rng))


def _reasoning(rng: random.Random) -> str:
    p = rng.sample(PEOPLE, 4)
    a = rng.randint(5, 30)
    chickens = rng.randint(1, a - 1)
    tens = rng.randint(1, a - 1)
    return _pick(rng, REASONING, p1=p[0], p2=p[1], p3=p[2], p4=p[3], person=p[0],
                 a=a,
                 b=5 * (a - tens) + 10 * tens if rng.random() < 0.5 else rng.randint(3, 12),
                 legs=2 * chickens + 4 * (a - chickens), group=rng.choice(GROUPS),
                 topic=rng.choice(TOPICS))


def _math(rng: random.Random) -> str:
    v = [rng.randint(-9, 12) for _ in range(5)]
    return _pick(rng, MATH, a=abs(v[0]) + 1, b=abs(v[1]) + 2, c=v[2] + 20, d=abs(v[3]) + 1,
                 e=v[4], p=rng.choice([5, 10, 15, 20, 25, 30]), person=_name(rng),
                 money=rng.choice([500, 1000, 2500, 10000]), n=rng.randint(2, 6),
                 s6=6 * rng.randint(3, 60) + 6)


def _coding(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES[:6])
    c1, c2 = rng.choice(CONCEPT_PAIRS)
    return _pick(rng, CODING, lang=lang, task=rng.choice(CODE_TASKS),
                 algorithm=rng.choice(ALGORITHMS), snippet=rng.choice(SNIPPETS),
                 records=rng.choice(["employees", "orders", "students", "weather readings"]),
                 report=rng.choice(["the average of each numeric column", "the ten largest "
                                    "rows", "totals grouped by month"]),
                 thing=rng.choice(["a bank account", "a library book", "a parking lot",
                                   "a to-do list", "a deck of cards"]),
                 m1=rng.choice(["add an item", "deposit money", "check availability"]),
                 m2=rng.choice(["remove an item", "print a summary", "undo the last change"]),
                 c1=c1, c2=c2, sql_goal=rng.choice(SQL_GOALS),
                 table=rng.choice(["orders(id, customer, amount, date)",
                                   "employees(id, name, department, salary)"]))


def _extraction(rng: random.Random) -> str:
    months = ["January", "February", "March", "April", "May", "June"]
    sales = ", ".join(f"{m} {rng.randint(80, 990)} units" for m in months[: rng.randint(4, 6)])
    return _pick(rng, EXTRACTION, people=_document("people", rng), reviews=_document("reviews", rng),
                 report=_document("report", rng), events=_document("schedule", rng), sales=sales,
                 email=_email(rng))


def _stem(rng: random.Random) -> str:
    t1, t2 = rng.choice(TECH_PAIRS)
    return _pick(rng, STEM, phenomenon=rng.choice(PHENOMENA), system=rng.choice(SYSTEMS),
                 change=rng.choice(CHANGES), obj=rng.choice(["car", "ball", "bicycle", "train"]),
                 a=rng.randint(1, 2000), b=rng.randint(2, 40), process=rng.choice(PROCESSES),
                 domain=rng.choice(DOMAINS), tech1=t1, tech2=t2, audience=rng.choice(AUDIENCES))


def _humanities(rng: random.Random) -> str:
    t1, t2 = rng.sample(THINKERS, 2)
    return _pick(rng, HUMANITIES, event=rng.choice(EVENTS), domain=rng.choice(DOMAINS),
                 thinker1=t1, thinker2=t2, theme=rng.choice(THEMES),
                 claim=rng.choice(CLAIMS),
                 work=rng.choice(WORKS))


_KINDS: dict[str, Callable[[random.Random], str]] = {
    "writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math,
    "coding": _coding, "extraction": _extraction, "stem": _stem, "humanities": _humanities,
}


def _name(rng: random.Random) -> str:
    return f"{rng.choice(PEOPLE)} {rng.choice(SURNAMES)}"


def _email(rng: random.Random) -> str:
    who = _name(rng)
    return (f"Hi team, the venue in {rng.choice(CITIES)} costs ${rng.randint(400, 4000)} for "
            f"{rng.choice(['March', 'June', 'October'])} {rng.randint(2, 28)}, and the catering "
            f"quote is ${rng.randint(200, 3000)}. The deposit of ${rng.randint(100, 900)} is due "
            f"by {rng.choice(['Friday', 'the 15th', 'next Monday'])}. Best, {who}")


JOBS = ["nurse", "software engineer", "teacher", "architect", "electrician", "journalist",
        "marketing manager", "data analyst", "chef", "pilot", "lawyer", "graphic designer"]
OBJECTS = ["an old key", "a pocket watch", "a letter with no name", "a red umbrella",
           "a map drawn by hand", "a photograph from 1962", "a locked wooden box"]
PRODUCT_NAMES = ["a smart water bottle", "a solar-powered backpack", "a language-learning app",
                 "an electric bicycle", "a noise-cancelling sleep mask", "a plant-watering robot"]
FEATURES = ["a battery that lasts a month", "it works without an internet connection",
            "it folds to the size of a book", "it reminds you gently instead of nagging",
            "it is made entirely from recycled materials"]
AUDIENCES = ["busy parents", "college students", "retired people", "small business owners",
             "first-time travellers", "children aged 8 to 10", "software developers"]
SENTENCES = ["The meeting that we had yesterday was a meeting that went on for a very long time "
             "and nothing was decided.", "She walked to the store because she needed some food "
             "and also she wanted to walk.", "It is important to note that the results are in "
             "fact quite good in a lot of ways."]
CUISINES = ["Ethiopian", "Korean", "Peruvian", "Lebanese", "Italian", "Thai", "Georgian"]
PROBLEMS = ["a heating system that has been broken for two weeks", "a leaking kitchen ceiling",
            "noise from building work starting at 6 am", "a broken front-door lock"]
VISITOR_QUESTIONS = ["What is the hardest part of your work?", "What do you miss most?",
                     "What advice would you give someone starting out?",
                     "What was the best day of your life?", "Why did you choose this life?"]
GROUPS = ["musicians", "doctors", "gardeners", "students", "pilots", "painters"]
SNIPPETS = ["def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1",
            "def is_even(n):\n    return n % 2 == 1",
            "def last(items):\n    return items[len(items)]",
            "def count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou' and c.isupper())"]
CONCEPT_PAIRS = [("a process", "a thread"), ("a list", "a set"), ("recursion", "iteration"),
                 ("an abstract class", "an interface"), ("a stack", "a queue"),
                 ("pass by value", "pass by reference"), ("SQL", "NoSQL databases")]
SQL_GOALS = ["the three customers who spent the most last year", "the average salary per "
             "department, highest first", "every order placed on a weekend",
             "customers with no orders in the last six months"]
SYSTEMS = ["the Earth's climate", "a forest ecosystem", "the human heart", "a city's power grid",
           "the ocean's food chain"]
CHANGES = ["the Moon disappeared", "the average temperature rose by 4 degrees", "all bees "
           "vanished", "the Earth spun twice as fast", "every car became electric overnight"]
PROCESSES = ["water purification", "protein synthesis", "steel making", "recycling plastic",
             "how a bill becomes law", "fermentation"]
DOMAINS = ["public health", "the economy", "education", "the environment", "art and music",
           "politics", "science"]
TECH_PAIRS = [("solar power", "wind power"), ("LCD screens", "OLED screens"),
              ("hybrid cars", "electric cars"), ("SSDs", "hard disk drives"),
              ("4G", "5G networks"), ("nuclear power", "natural gas")]
THEMES = ["justice", "happiness", "freedom", "the role of the state", "education", "virtue"]
CLAIMS = ["social media has done more harm than good", "homework should be abolished",
          "museums should return objects to their countries of origin", "space exploration is "
          "worth its cost", "art can be created by machines"]
WORKS = ["Shakespeare's Hamlet", "George Orwell's 1984", "Homer's Odyssey", "Jane Austen's "
         "Pride and Prejudice", "Mary Shelley's Frankenstein", "Cervantes' Don Quixote"]
