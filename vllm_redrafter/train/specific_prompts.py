"""Specific requests, a second stock: other wordings, longer subject lists, other documents.

The built-in dataset's source ``specific``: ``specific_prompts(n, seed)`` gives ``n`` distinct
requests, the same eight kinds of task as detailed_prompts.py in turn, reproducible from
``seed``. Its templates are its own (requests with a personal context, puzzles with computed
numbers, physics and economics with figures, documents such as invoices, job ads and meeting
notes to extract from) and its subject lists several times longer. The wording is ours, not the
target's. No six-word window of an MT-Bench question appears in them (``tests/test_train.py``).

Why a second stock, and what it gave: docs/training.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from vllm_redrafter.train.detailed_prompts import _name, _pick, draw_in_turn
from vllm_redrafter.train.prompts import CITIES, LANGUAGES, PEOPLE, SURNAMES, TOPICS, _a

SCIENCE = [
    "photosynthesis", "cellular respiration", "DNA replication", "natural selection", "enzymes",
    "vaccines", "antibiotic resistance", "the nervous system", "hormones", "viruses",
    "the carbon cycle", "the nitrogen cycle", "ocean currents", "plate tectonics", "earthquakes",
    "volcanic eruptions", "weather fronts", "hurricanes", "Newton's laws of motion", "friction",
    "momentum", "the conservation of energy", "heat engines", "entropy", "electric circuits",
    "electromagnetic induction", "the refraction of light", "lenses", "sound waves",
    "radioactive decay", "nuclear fission", "the life cycle of stars", "the expansion of the "
    "universe", "satellite orbits", "the seasons", "chemical bonds", "acids and bases", "rust",
    "catalysts", "polymers", "isotopes", "semiconductors", "lasers", "lithium-ion batteries",
    "solar cells", "wind turbines", "how data travels across the internet", "public-key "
    "encryption", "image compression", "exponential growth", "blood pressure", "the kidneys",
    "sleep and memory", "the gut microbiome", "soil erosion", "coral bleaching", "invasive "
    "species", "gene editing", "the placebo effect", "aerodynamic lift", "buoyancy",
    "thermal expansion", "the greenhouse effect", "superconductors", "the speed of sound",
]
HUMANITIES = [
    "the causes of the First World War", "the Cold War", "the Reformation", "the Enlightenment",
    "colonialism in Africa", "ancient Athenian democracy", "the Roman Republic", "the Meiji "
    "Restoration", "the Mughal Empire", "the civil rights movement", "women's suffrage",
    "the Great Depression", "the Marshall Plan", "globalisation", "inflation", "supply and "
    "demand", "minimum wage laws", "universal basic income", "free trade", "monopolies",
    "the tragedy of the commons", "utilitarianism", "Kant's categorical imperative",
    "virtue ethics", "existentialism", "free will", "the social contract", "Stoicism",
    "Confucian ethics", "the scientific method", "censorship", "propaganda", "privacy",
    "urbanisation", "migration", "how languages change", "the origins of writing", "Greek "
    "tragedy", "the Romantic poets", "the modern novel", "Impressionist painting", "the "
    "history of jazz", "Gothic cathedrals", "nationalism", "the Silk Road", "the Black Death",
    "the Ottoman Empire", "the partition of India", "apartheid", "the European Union",
    "opportunity cost", "comparative advantage", "central banks", "game theory",
]
RELATIVES = ["grandmother", "older brother", "best friend", "aunt", "father", "colleague",
             "neighbour", "daughter", "mentor", "sister-in-law"]
HOBBIES = ["fishing", "gardening", "crossword puzzles", "salsa dancing", "restoring old cars",
           "birdwatching", "baking", "chess", "marathon running", "painting watercolours"]
BUSINESSES = ["a small bakery", "a bike repair shop", "a yoga studio", "a second-hand bookshop",
              "a dog-walking service", "a family restaurant", "a plant nursery",
              "a language school", "a tattoo studio", "a coworking space", "a food truck"]
PIECES = ["a short website introduction", "an Instagram caption", "a flyer", "a newsletter "
          "paragraph", "a reply to a bad online review", "a job advert", "a welcome email for new "
          "customers", "a sign for the shop window", "a radio advert of 30 seconds"]
PURPOSES = ["our summer sale", "our tenth anniversary", "a new opening-hours schedule",
            "a charity day", "hiring a part-time assistant", "a price increase"]
TONES = ["warm", "professional", "playful", "calm", "confident", "light-hearted", "respectful"]
GENRES = ["science-fiction", "ghost", "detective", "fairy-tale", "comedy", "adventure", "romance"]
GOALS = ["return a library book that is 40 years overdue", "find a lost recipe", "win back a "
         "friend's trust", "deliver a letter across a frozen lake", "repair a broken lighthouse",
         "convince a village to move", "escape a museum after closing time"]
PLACES = ["a fish market", "an empty train station", "a mountain hut", "a busy hospital corridor",
          "a night bus", "an old library", "a desert campsite", "a school playground"]
TIMES = ["dawn", "noon", "dusk", "midnight", "the first snow of winter", "a summer storm"]
CHARACTERS = ["a Roman centurion", "a lighthouse keeper", "a Victorian inventor", "a wise old "
              "tortoise", "an air-traffic controller", "a royal chef", "a deep-sea diver",
              "a retired spy", "a ghost in an old theatre", "a talking parrot", "a queen in exile",
              "an explorer lost in the Amazon", "a jazz musician in 1950s New York"]
EXPERTS = ["a financial adviser", "a family doctor", "an architect", "a veterinarian",
           "a career coach", "a nutritionist", "a lawyer specialising in rent", "an IT consultant",
           "a wedding planner", "a sleep specialist"]
CLIENT_QUESTIONS = ["whether they should pay off their loan or invest the money",
                    "how to make a small flat feel bigger", "why their dog will not eat",
                    "how to get back into work after five years away", "what to eat before a "
                    "long bike ride", "what to do about a landlord who keeps the deposit",
                    "how to protect a small office from ransomware", "how to sleep better after "
                    "night shifts"]
MODERN = ["a smartphone", "a supermarket", "an aeroplane", "a video call", "a vending machine",
          "an escalator", "a football stadium"]
HISTORICAL = ["a medieval monk", "Cleopatra", "a Viking sailor", "Leonardo da Vinci",
              "a Roman senator", "a samurai", "an Egyptian scribe"]
SETTINGS = ["an abandoned space station", "a haunted manor", "an underwater city",
            "a jungle temple", "a floating market", "a clockwork town"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ITEMS = ["laptops", "chairs", "notebooks", "lamps", "backpacks", "mugs", "bicycles", "helmets"]
DEPARTMENTS = ["Sales", "Marketing", "Support", "Finance", "Engineering", "Logistics"]
DISHES = ["lentil soup", "banana bread", "chicken curry", "vegetable lasagne", "pancakes"]
INGREDIENTS = ["flour", "sugar", "butter", "eggs", "onions", "garlic", "milk", "rice", "lentils",
               "tomatoes", "olive oil", "salt"]


# -- templates, by kind ----------------------------------------------------------------------------

WRITING = [
    "I run {business} in {city} and need {piece} about {purpose}. Keep it under {words} words and "
    "make the tone {tone}.",
    "My {relative} turns {age} next month. Write a toast I can give at the party that mentions "
    "their love of {hobby}, and keep it under two minutes when read aloud.",
    "Write a {genre} story of about {words} words in which {character} has to {goal}. End with a "
    "twist.",
    "Describe {place} at {time} in one paragraph that uses all five senses.",
    "Write a friendly thank-you note to {person}, who helped me move house last weekend. Mention "
    "one specific thing they did.",
    "Write a blog post for {audience} about {topic}: a catchy title, three short sections with "
    "headings, and a one-line summary at the end.",
    "Rewrite the following message so it sounds {tone} instead of annoyed: \"{message}\"",
    "Write a short motivational letter to a student who failed an exam in {subject}, giving two "
    "practical tips for next time.",
    "Write the first page of a diary kept by {character}, dated {date}.",
    "Create a slogan and a 50-word description for {business} that wants to attract {audience}.",
]
ROLEPLAY = [
    "From now on you are {character}. {asker} asks you: {question} Answer in character.",
    "Pretend to be {expert}. A client asks you {client_question}. Give your advice as you would "
    "in a real appointment.",
    "You are the narrator of a text adventure set in {setting}, where I am looking for "
    "{treasure}. Describe where I wake up and give me three choices.",
    "Act as {historical} who has just seen {modern} for the first time. Describe your reaction "
    "to {asker_lower}.",
    "Be my {language} conversation partner: you are {service} in {city}, and I am a tourist. "
    "Start the conversation.",
    "Imagine you are {character} writing a complaint to the king about {problem}. Stay in "
    "character.",
    "You are a tour guide in {city}. A group of {visitors} has {hours} hours. Welcome them and "
    "describe the route.",
    "Play the role of a strict but fair interviewer for a job as {a_job}. Ask me one question at "
    "a time, starting now.",
    "You are {character} and {asker_lower} wants to become your apprentice. Tell them what the "
    "first week will be like.",
]
ASKERS = ["A curious child", "A journalist", "A nervous new neighbour", "A time traveller",
          "A suspicious police officer", "An old friend", "A student writing a report"]
QUESTIONS = ["what was the strangest day of your life?", "what do you fear most?",
             "what would you change about your job?", "who was your greatest rival?",
             "what is the secret of your success?", "what do you eat for breakfast?",
             "what is the best advice you ever received?", "where do you go to be alone?"]
TREASURES = ["a lost map", "my missing sister", "the key to the exit", "a golden compass",
             "the last working radio", "a stolen painting"]
SERVICES = ["a waiter in a cafe", "a hotel receptionist", "a taxi driver", "a market seller",
            "a pharmacist", "a ticket seller at a station"]
VISITORS = ["teenagers on a school trip", "retired teachers", "engineers at a conference",
            "families with young children", "architecture students", "food lovers"]
LANGUAGES_SPOKEN = ["Spanish", "French", "German", "Italian", "Portuguese", "Japanese"]
REASONING = [
    "{p1} is taller than {p2}, {p3} is shorter than {p2}, and {p4} is taller than {p1}. Who is "
    "the shortest, and who is the second tallest? Explain.",
    "What number comes next in the sequence {sequence}? Explain the pattern.",
    "If today is {day}, what day of the week will it be in {k} days? Show how you work it out.",
    "There are {n} people at a meeting and everyone shakes hands with everyone else once. How "
    "many handshakes are there? Explain the reasoning.",
    "All {group} in this town own a bicycle, and {p1} owns a bicycle. Can we conclude that {p1} "
    "is one of the {group}? Explain why or why not.",
    "A box holds {r} red and {b} blue socks in the dark. How many socks must you take out to be "
    "sure of having a matching pair? And a pair of blue socks?",
    "{p1} says: \"{p2} is lying.\" {p2} says: \"{p3} is lying.\" {p3} says: \"{p1} and {p2} are "
    "both lying.\" Who is telling the truth?",
    "A snail climbs {up} metres up a {h}-metre wall each day and slips back {down} metre each "
    "night. On which day does it reach the top?",
    "In a race, {p1} finished ahead of {p2} but behind {p3}, and {p4} finished last. Who came "
    "second?",
]
MATH = [
    "Solve the system of equations {a}x + {b}y = {c} and {d}x - {e}y = {f}. Show your steps.",
    "A rectangle is {k} cm longer than it is wide and its area is {area} square centimetres. "
    "Find its length and width.",
    "A train leaves at 9:00 travelling at {v1} km/h. A second train leaves the same station at "
    "{t2}:00 on the same track at {v2} km/h. When does the second catch the first?",
    "Differentiate p(x) = {d} + {c}x + {b}x^2 + {a}x^3, and find the values of x where the slope "
    "of p is zero.",
    "In how many ways can {n} different books be arranged on a shelf if two particular books "
    "must stand next to each other?",
    "A price is cut by {p}% and the new price is then raised by {q}%. Is the final price higher "
    "or lower than the original, and by what percentage?",
    "Without a calculator, find what is left over after dividing {big} by {m}, and explain the "
    "method.",
    "A circle has a circumference of {circumference} cm. What are its radius and its area? Round to two "
    "decimals.",
    "{person} saves {s} dollars in the first month and {k} dollars more each month than the "
    "month before. How much has {person} saved after a year?",
    "Two dice are rolled. What is the probability that the sum is {sum}? Explain by listing the "
    "outcomes.",
]
CODING = [
    "Write a {lang} function that {task}. Include two test cases and explain the edge cases.",
    "Implement a {structure} class in {lang} with methods to {m1} and {m2}, and give the time "
    "complexity of each.",
    "How would you design {system}? Describe the main components, the data they store and how "
    "they talk to each other, and which part you would write in {lang}.",
    "Write a regular expression that matches {pattern}, and explain each part of it. Show it in "
    "a short {lang} example.",
    "Explain the difference between {c1} and {c2} in {lang}, with a short example of each.",
    "My {lang} program is slow when processing {big} records of {records}. What are the likely "
    "causes and how would you profile it?",
    "Write a SQL query on the table {table} that returns {goal}, and explain how it works.",
    "Write a command-line script in {lang} that reads a CSV file of {records} and prints "
    "{report}.",
    "Review this Python code and point out the bug, then show the fix in {lang}:\n\n{snippet}",
]
EXTRACTION = [
    "From the invoice below, extract the supplier, the date, every item with its quantity and "
    "price, and the total, as JSON.\n\n{invoice}",
    "Read this job posting and list the job title, the location, the salary range and the "
    "required skills.\n\n{job}",
    "From these meeting notes, list every decision taken and every task with its owner and "
    "deadline, as a table.\n\n{notes}",
    "Here is a recipe. Return the ingredients as a JSON list with quantities, then count the "
    "steps.\n\n{recipe}",
    "From the travel itinerary below, give the dates, cities and hotels in order, and the total "
    "number of nights.\n\n{itinerary}",
    "Here is a list of transactions. Which category did the most money go to, and what is the "
    "total spent?\n\n{transactions}",
    "Read the following results and report who won each match and which team scored the most "
    "goals overall.\n\n{results}",
    "Extract the names of all the cities and the temperatures from this forecast, sorted from "
    "warmest to coldest.\n\n{forecast}",
]
STEM = [
    "Explain {science} step by step: what happens and why. Then correct one common "
    "misconception about it.",
    "Explain {science} to {audience}, using an analogy from everyday life.",
    "How could a school laboratory demonstrate {science}? List the equipment and the steps.",
    "A {m} kg box is lifted {h} metres. How much potential energy does it gain, and how fast "
    "would it move just before hitting the ground if dropped?",
    "A circuit has a {v} V battery and a {r} ohm resistor. What current flows, and how much "
    "power does the resistor use?",
    "Light travels at about 300,000 km per second. How long does it take to cover {d} million "
    "kilometres? Show the calculation.",
    "In everyday life and in industry, where do we meet {science}, and what is still not "
    "understood about it?",
    "What is the link between {science} and {science2}? Explain as clearly as you can.",
]
HUMANITIES_TEMPLATES = [
    "What were the main causes and consequences of {humanities}?",
    "Explain {humanities} and give a real-world example of it today.",
    "Evaluate the claim that {claim}. Which arguments on each side are strongest?",
    "Write a short dialogue in which two students debate {humanities}; give each one good "
    "arguments.",
    "What can leaders today learn from {humanities}? Give three lessons.",
    "How has {humanities} been shown in art, film or literature? Give three examples.",
    "Summarise the main positions in the debate about {humanities} for a high-school class.",
    "Compare {humanities} with {humanities2}: what do they have in common?",
]
CLAIMS = ["cities should ban cars from their centres", "voting should be compulsory",
          "history is written by the winners", "money cannot buy happiness", "tourism does more "
          "harm than good", "schools should teach philosophy", "a four-day working week would "
          "help everyone", "libraries are no longer needed"]
TASKS = ["returns the longest word in a sentence", "checks whether two strings are anagrams",
         "flattens a nested list", "counts the vowels in each word of a text", "returns the "
         "median of a list of numbers", "converts a temperature from Celsius to Fahrenheit and "
         "back", "finds all pairs in a list that add up to a target", "validates an email "
         "address", "rotates a matrix by 90 degrees", "returns the most frequent character in a "
         "string", "merges overlapping intervals", "checks whether brackets in a string are "
         "balanced", "splits a list into chunks of a given size", "returns the n-th prime number",
         "removes every second element of a list", "finds the longest common prefix of several "
         "strings", "converts a number to words in English", "computes the running average of "
         "a stream of numbers", "checks whether a year is a leap year", "returns the dates of "
         "every Monday in a month", "compresses a string like aaabb into a3b2",
         "transposes a table given as a list of rows", "shuffles a list without a library "
         "function", "finds the missing number in a list of 1 to n"]
STRUCTURES = ["stack", "queue", "linked list", "binary search tree", "min-heap", "LRU cache",
              "hash map", "priority queue"]
STRUCTURE_METHODS = [("insert an element", "remove the smallest element"), ("add an item",
                     "look up an item"), ("push", "pop"), ("append", "reverse the whole thing")]
DESIGNS = ["a URL shortener", "a chat application", "an online library catalogue", "a parking "
           "reservation system", "a to-do app that syncs across devices", "a leaderboard for an "
           "online game", "a booking system for a hair salon", "a news feed", "a ride-sharing "
           "app", "a file backup service", "a rate limiter for an API", "an online voting system"]
PATTERNS = ["UK postcodes", "dates written as DD/MM/YYYY", "hexadecimal colour codes", "IPv4 "
            "addresses", "phone numbers with an optional country code", "words that start and "
            "end with the same letter", "times in 24-hour format", "prices such as $4.99",
            "hashtags", "strong passwords of at least 12 characters"]
CONCEPT_PAIRS = [("mutable", "immutable objects"), ("compilation", "interpretation"),
                 ("shallow copy", "deep copy"), ("synchronous", "asynchronous code"),
                 ("static", "dynamic typing"), ("exceptions", "error codes")]
TABLES = ["orders(id, customer_id, total, created_at)", "students(id, name, grade, class)",
          "flights(id, origin, destination, departure, price)", "books(id, title, author, year)"]
QUERY_GOALS = ["the five most recent rows", "the number of rows per group, largest first",
               "rows whose price is above the average", "duplicates by name"]
BUGGY = [
    "def find_max(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n"
    "    return best",
    "def reverse(s):\n    out = ''\n    for i in range(len(s)):\n        out += s[len(s) - i]\n"
    "    return out",
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else sum(xs) / 0",
    "def is_prime(n):\n    for d in range(2, n):\n        if n % d == 0:\n            return False\n"
    "    return True",
]
MESSAGES = ["You still haven't sent the report. I asked three times.", "Why is the kitchen always "
            "a mess when I get home?", "The parcel arrived broken again and nobody answers the "
            "phone."]
SUBJECTS = ["chemistry", "history", "algebra", "French", "biology", "economics"]
ROLE_PROBLEMS = ["the new tax on bread", "dragons eating the sheep", "the broken bridge",
                 "the noisy court musicians"]
AUDIENCES = ["a ten-year-old", "a high-school student", "a busy manager", "a retired engineer",
             "a group of tourists", "someone who has never studied science", "a new employee"]


# -- makers ------------------------------------------------------------------------------------------


def specific_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct specific requests, the eight kinds in turn, reproducible from ``seed``."""
    return draw_in_turn(list(_KINDS.values()), n, random.Random(seed + 7))


def _writing(rng: random.Random) -> str:
    return _pick(rng, WRITING, business=rng.choice(BUSINESSES), city=rng.choice(CITIES),
                 piece=rng.choice(PIECES), purpose=rng.choice(PURPOSES),
                 words=rng.choice([80, 100, 150, 200, 300, 400]), tone=rng.choice(TONES),
                 relative=rng.choice(RELATIVES), age=rng.choice([30, 40, 50, 60, 70, 80, 90]),
                 hobby=rng.choice(HOBBIES), genre=rng.choice(GENRES),
                 character=rng.choice(CHARACTERS), goal=rng.choice(GOALS),
                 place=rng.choice(PLACES), time=rng.choice(TIMES), person=_name(rng),
                 audience=rng.choice(AUDIENCES), topic=rng.choice(TOPICS),
                 message=rng.choice(MESSAGES), subject=rng.choice(SUBJECTS),
                 date=f"{rng.randint(1, 28)} {rng.choice(['March', 'July', 'November'])} "
                      f"{rng.randint(1700, 2090)}")


def _roleplay(rng: random.Random) -> str:
    asker = rng.choice(ASKERS)
    return _pick(rng, ROLEPLAY, character=rng.choice(CHARACTERS), expert=rng.choice(EXPERTS),
                 client_question=rng.choice(CLIENT_QUESTIONS), setting=rng.choice(SETTINGS),
                 historical=rng.choice(HISTORICAL), modern=rng.choice(MODERN),
                 city=rng.choice(CITIES), problem=rng.choice(ROLE_PROBLEMS),
                 visitors=rng.choice(VISITORS), hours=rng.choice([2, 3, 4, 6]),
                 a_job=_a(rng.choice(["nurse", "data analyst", "pilot", "chef", "teacher",
                                      "lawyer", "game designer", "zookeeper"])),
                 asker=asker, asker_lower=asker[0].lower() + asker[1:],
                 question=rng.choice(QUESTIONS), treasure=rng.choice(TREASURES),
                 service=rng.choice(SERVICES), language=rng.choice(LANGUAGES_SPOKEN))


def _reasoning(rng: random.Random) -> str:
    p = rng.sample(PEOPLE, 4)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    sequence = rng.choice([
        [start + step * i for i in range(5)], [start * 2 ** i for i in range(5)],
        [i * i + start for i in range(1, 6)], [start + i * (i + 1) // 2 for i in range(5)]])
    h = rng.randint(8, 20)
    return _pick(rng, REASONING, p1=p[0], p2=p[1], p3=p[2], p4=p[3],
                 sequence=", ".join(map(str, sequence)) + ", ...", day=rng.choice(DAYS),
                 k=rng.randint(10, 400), n=rng.randint(5, 30), group=rng.choice(
                     ["teachers", "students", "doctors", "postmen"]), r=rng.randint(3, 20),
                 b=rng.randint(3, 20), up=rng.randint(2, 4), down=1, h=h)


def _math(rng: random.Random) -> str:
    a, b, d, e = (rng.randint(1, 9) for _ in range(4))
    x, y = rng.randint(-5, 9), rng.randint(-5, 9)
    w, k = rng.randint(3, 15), rng.randint(2, 9)
    return _pick(rng, MATH, a=a, b=b, c=a * x + b * y, d=d, e=e, f=d * x - e * y, k=k,
                 area=w * (w + k), v1=rng.choice([60, 80, 90, 100]),
                 v2=rng.choice([120, 140, 150, 160]), t2=rng.randint(10, 12), n=rng.randint(4, 9),
                 p=rng.choice([10, 20, 25, 30, 40]), q=rng.choice([10, 20, 25, 30, 50]),
                 big=rng.randint(10 ** 5, 10 ** 7), m=rng.choice([3, 4, 7, 9, 11]),
                 person=_name(rng), s=rng.choice([20, 50, 100]), sum=rng.randint(2, 12),
                 circumference=rng.randint(5, 200))


def _coding(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES[:6])
    m1, m2 = rng.choice(STRUCTURE_METHODS)
    c1, c2 = rng.choice(CONCEPT_PAIRS)
    return _pick(rng, CODING, lang=lang, task=rng.choice(TASKS), structure=rng.choice(STRUCTURES),
                 m1=m1, m2=m2, system=rng.choice(DESIGNS), pattern=rng.choice(PATTERNS), c1=c1,
                 c2=c2, big=rng.choice(["100,000", "2 million", "50 million"]),
                 records=rng.choice(["sales", "sensor readings", "log lines", "customers"]),
                 table=rng.choice(TABLES), goal=rng.choice(QUERY_GOALS),
                 report=rng.choice(["the total per month", "the largest value in each column",
                                    "how many rows are missing a value"]),
                 snippet=rng.choice(BUGGY))


def _extraction(rng: random.Random) -> str:
    return _pick(rng, EXTRACTION, invoice=_invoice(rng), job=_job(rng), notes=_notes(rng),
                 recipe=_recipe(rng), itinerary=_itinerary(rng), transactions=_transactions(rng),
                 results=_results(rng), forecast=_forecast(rng))


def _stem(rng: random.Random) -> str:
    s1, s2 = rng.sample(SCIENCE, 2)
    return _pick(rng, STEM, science=s1, science2=s2, audience=rng.choice(AUDIENCES),
                 m=rng.randint(2, 80), h=rng.randint(2, 40), v=rng.choice([3, 6, 9, 12, 24]),
                 r=rng.choice([2, 4, 8, 10, 50, 100]), d=rng.choice([1, 40, 150, 228, 780]))


def _humanities(rng: random.Random) -> str:
    h1, h2 = rng.sample(HUMANITIES, 2)
    return _pick(rng, HUMANITIES_TEMPLATES, humanities=h1, humanities2=h2,
                 claim=rng.choice(CLAIMS))


_KINDS: dict[str, Callable[[random.Random], str]] = {
    "writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math,
    "coding": _coding, "extraction": _extraction, "stem": _stem, "humanities": _humanities,
}


# -- documents to extract from -----------------------------------------------------------------------


def _invoice(rng: random.Random) -> str:
    lines = [f"- {rng.randint(1, 12)} x {item} at ${rng.randint(5, 400)}.00"
             for item in rng.sample(ITEMS, rng.randint(2, 4))]
    return (f"INVOICE {rng.randint(1000, 9999)}\nFrom: {rng.choice(SURNAMES)} Supplies, "
            f"{rng.choice(CITIES)}\nDate: {rng.randint(1, 28)}/{rng.randint(1, 12)}/"
            f"{rng.randint(2019, 2025)}\n" + "\n".join(lines) + "\nPayment due in 30 days.")


def _job(rng: random.Random) -> str:
    low = rng.randint(30, 90)
    skills = ", ".join(rng.sample(["Python", "Excel", "customer service", "project management",
                                   "German", "SQL", "design tools", "a driving licence"], 3))
    return (f"{rng.choice(SURNAMES)} & Co is hiring {_a(rng.choice(['data analyst', 'office manager', 'sales lead', 'web developer']))} "
            f"in {rng.choice(CITIES)}. Salary: ${low},000 to ${low + rng.randint(5, 30)},000. "
            f"You will need {skills}. Apply by {rng.randint(1, 28)} "
            f"{rng.choice(['May', 'June', 'September'])}.")


def _notes(rng: random.Random) -> str:
    p = rng.sample(PEOPLE, 3)
    return (f"Meeting, {rng.choice(DAYS)}. Present: {', '.join(p)}. {p[0]} reported that the "
            f"{rng.choice(DEPARTMENTS)} budget is {rng.randint(5, 30)}% over. Decided: move the "
            f"launch to {rng.choice(['March', 'April', 'August'])}. {p[1]} will update the plan "
            f"by {rng.choice(DAYS)}; {p[2]} will call the supplier before the end of the week.")


def _recipe(rng: random.Random) -> str:
    parts = ", ".join(f"{rng.randint(1, 500)} g {i}" for i in rng.sample(INGREDIENTS, 4))
    return (f"{rng.choice(DISHES).title()} for {rng.randint(2, 8)}: {parts}. Mix the dry "
            f"ingredients, add the rest, cook for {rng.randint(10, 60)} minutes, and rest for "
            f"{rng.randint(2, 15)} minutes before serving.")


def _itinerary(rng: random.Random) -> str:
    day = rng.randint(1, 20)
    stops = []
    for city in rng.sample(CITIES, 3):
        nights = rng.randint(1, 4)
        stops.append(f"{day} June: arrive in {city}, {rng.choice(SURNAMES)} Hotel, {nights} nights.")
        day += nights
    return " ".join(stops)


def _transactions(rng: random.Random) -> str:
    cats = ["groceries", "rent", "transport", "eating out", "books", "electricity"]
    return "\n".join(f"{rng.randint(1, 28)} Oct, {rng.choice(cats)}, ${rng.randint(3, 900)}"
                     for _ in range(rng.randint(4, 7)))


def _results(rng: random.Random) -> str:
    teams = rng.sample(CITIES, 4)
    return "\n".join(f"{a} {rng.randint(0, 4)} - {rng.randint(0, 4)} {b}"
                     for a, b in [(teams[0], teams[1]), (teams[2], teams[3]),
                                  (teams[0], teams[2]), (teams[1], teams[3])])


def _forecast(rng: random.Random) -> str:
    return " ".join(f"{city}: {rng.choice(['sunny', 'cloudy', 'rain', 'windy'])}, "
                    f"{rng.randint(-5, 35)} degrees." for city in rng.sample(CITIES, 4))
