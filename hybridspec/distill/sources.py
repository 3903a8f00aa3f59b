"""Training text made offline from what the machine has: chat prompts for the target to
answer, and local documents.

The head drafts the target's chat answers, so most prompts are the requests people send:
explanations, advice, stories, poems, letters, word problems with random numbers, and
conversations that go on with a follow-up question. Their subjects come from the lists here
(everyday subjects, characters and events, combined at random), which reach far beyond what
local files are about. The rest are input-grounded (summarise, answer from, rewrite, comment on
a snippet) on local text: the docstrings of the Python standard library's modules (read with
``ast``, nothing imported), its source code, and the licence and copyright texts under
``/usr/share``, which the reading phase also takes teacher-forced. None of them is a benchmark
prompt (``tests/distill`` checks it against the bench workload).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_SNIPPET_CHARS = 200
MAX_SNIPPET_CHARS = 1500
SHARE_DIRS = (Path("/usr/share/common-licenses"), Path("/usr/share/doc"))
MAX_SHARE_FILES = 400
FOLLOW_UP_SHARE = 0.3  # open-ended prompts that go on with a second question


@dataclass(frozen=True, slots=True)
class Snippet:
    """A piece of local text, and a short name for what it is about."""

    topic: str
    text: str
    is_code: bool = False


def stdlib_snippets(limit: int, rng: random.Random) -> list[Snippet]:
    """Docstrings and function bodies from the standard library's ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    out: list[Snippet] = []
    for path in files:
        if len(out) >= limit:
            break
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        out.extend(_module_snippets(path.stem, source, tree))
    rng.shuffle(out)
    return out[:limit]


def _module_snippets(module: str, source: str, tree: ast.Module) -> Iterator[Snippet]:
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= MIN_SNIPPET_CHARS:
        yield Snippet(f"the {module} module", doc[:MAX_SNIPPET_CHARS])
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        text = ast.get_source_segment(source, node) or ""
        if MIN_SNIPPET_CHARS <= len(text) <= MAX_SNIPPET_CHARS:
            yield Snippet(f"{module}.{node.name}", text, is_code=True)


def share_snippets(limit: int, rng: random.Random) -> list[Snippet]:
    """Paragraphs of licence and copyright files under /usr/share."""
    files: list[Path] = []
    for directory in SHARE_DIRS:
        if directory.is_dir():
            files += sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix != ".gz")
    rng.shuffle(files)
    out: list[Snippet] = []
    for path in files[:MAX_SHARE_FILES]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for paragraph in text.split("\n\n"):
            paragraph = paragraph.strip()
            if MIN_SNIPPET_CHARS <= len(paragraph) <= MAX_SNIPPET_CHARS:
                topic = path.parent.name if path.name == "copyright" else path.name
                out.append(Snippet(f"the {topic} licence", paragraph))
    rng.shuffle(out)
    return out[:limit]


# Everyday subjects for open-ended prompts: the target's chat answers are what the head drafts
# most, so its data must cover the kinds of requests people send (stories, poems, letters,
# explanations, advice, word problems, conversations), on subjects far wider than local files.
SUBJECTS = (
    "growing tomatoes on a balcony",
    "saving money on groceries",
    "learning to play the guitar",
    "the water cycle",
    "how volcanoes form",
    "keeping a houseplant alive",
    "the history of bread",
    "why the sky changes colour at sunset",
    "training a puppy",
    "starting a morning routine",
    "public libraries",
    "recycling plastic",
    "how bees make honey",
    "the moon's phases",
    "planning a birthday party",
    "writing a good CV",
    "how vaccines work",
    "electric cars",
    "the first day at a new job",
    "camping in the mountains",
    "baking sourdough bread",
    "how airplanes stay in the air",
    "the Roman Empire",
    "climate and weather",
    "chess openings",
    "learning a new language",
    "drinking enough water",
    "a family road trip",
    "coral reefs",
    "how the heart pumps blood",
    "renting a first apartment",
    "time management for students",
    "the invention of the printing press",
    "composting kitchen waste",
    "sleeping better",
    "making friends in a new city",
    "how rainbows appear",
    "budgeting for a holiday",
    "the life of a honeybee colony",
    "autumn leaves",
    "a rainy afternoon",
    "old photographs",
    "street food",
    "a village market",
    "a football match",
    "a thunderstorm",
    "the ocean at night",
    "a grandmother's kitchen",
    "a long walk in the forest",
    "moving house",
    "a school trip",
    "learning to swim as an adult",
    "the solar system",
    "how magnets work",
    "desert animals",
    "the importance of breakfast",
    "running a small bakery",
    "caring for an old dog",
    "volunteering at an animal shelter",
    "cycling to work",
    "how computers store data",
    "the difference between weather and climate",
    "dinosaurs",
    "how trees communicate",
    "a museum visit",
    "photosynthesis in simple words",
    "healthy snacks for children",
    "preparing for an exam",
    "speaking in public",
    "knitting a scarf",
    "the Great Wall of China",
    "ancient Egypt",
    "how a bill becomes a law",
    "saving energy at home",
    "fixing a flat tyre",
    "a job interview",
    "teamwork",
    "kindness to strangers",
    "a summer festival",
    "mountain lakes",
    "how the internet works",
    "the life cycle of a butterfly",
    "keeping chickens",
    "writing a thank-you note",
    "choosing a good book",
    "how to brew tea",
    "coffee culture",
    "a city at dawn",
    "winter sports",
    "the first airplane flight",
    "an island holiday",
    "learning to code",
    "friendship",
    "homesickness",
    "a lost umbrella",
    "a surprise visit",
    "a broken clock",
    "a quiet library",
    "a busy train station",
    "a secret garden",
    "an old bicycle",
    "the night sky",
    "the smell of rain",
    "a forgotten letter",
    "a new neighbour",
    "a snowy mountain cabin",
    "a street musician",
    "a fishing village",
    "how earthquakes happen",
    "the human brain",
    "why we dream",
    "how soap cleans",
    "the stock market in simple terms",
    "interest on a savings account",
    "first aid basics",
    "stretching after exercise",
    "meal planning for a busy week",
    "a vegetable soup recipe",
    "how glaciers move",
    "the Amazon rainforest",
    "wind power",
    "how a bicycle works",
    "the history of the Olympic Games",
    "sharks",
    "owls",
    "elephants",
    "migrating birds",
    "how to give feedback to a colleague",
    "working from home",
    "a difficult conversation",
    "organising a messy desk",
    "the benefits of walking",
    "a school science fair",
    "keeping a diary",
    "painting with watercolours",
    "photography for beginners",
)
CHARACTERS = (
    "a retired teacher",
    "a young baker",
    "a curious cat",
    "a lonely robot",
    "a shy giant",
    "a travelling musician",
    "a clever fox",
    "an old fisherman",
    "a girl who collects stones",
    "a nervous astronaut",
    "a village doctor",
    "a talking tree",
    "a detective on holiday",
    "twin brothers",
    "a street sweeper",
    "a forgetful wizard",
    "a tiny mouse",
    "a farmer",
    "a new student",
    "a grumpy neighbour",
    "a gardener",
    "a bus driver",
    "a brave squirrel",
    "a kite maker",
    "a chef who lost her sense of taste",
    "a clockmaker",
    "a young inventor",
)
EVENTS = (
    "finds a key that opens nothing",
    "wins a prize by mistake",
    "gets lost in a new city",
    "meets an old friend after twenty years",
    "discovers a hidden room",
    "learns to fly",
    "has to cook for a hundred people",
    "finds a map in a library book",
    "misses the last bus home",
    "receives a strange parcel",
    "plants a magic seed",
    "tries to break a world record",
    "loses something precious",
    "helps a stranger",
    "wakes up in the future",
    "opens a shop",
    "goes on a long journey",
    "starts a band",
)
OPEN_PROMPTS = (
    "Explain {s} to a beginner.",
    "Write a short poem about {s}.",
    "Write a short story about {s}.",
    "Give me three practical tips about {s}.",
    "What are common mistakes people make with {s}?",
    "Write a friendly email to a colleague about {s}.",
    "Write a blog post introduction about {s}.",
    "Tell me five interesting facts about {s}.",
    "Describe {s} in one paragraph for a ten-year-old.",
    "What are the pros and cons of {s}?",
    "Write a haiku about {s}.",
    "Give me a step-by-step guide to {s}.",
)
STORY_PROMPTS = (
    "Write a short story about {c} who {e}.",
    "Write a poem about {c} who {e}.",
    "Write the first scene of a story in which {c} {e}.",
    "Write a fable in which {c} {e}, and end it with a moral.",
    "Write a letter from {c} to a friend about {s}.",
    "Write a short dialogue between {c} and {c2} about {s}.",
)
FOLLOW_UPS = (
    "Can you explain that more simply?",
    "Thanks! Could you give me a concrete example?",
    "Can you make that shorter, as a list?",
    "Why is that so? Please explain a bit more.",
    "What should I do first?",
    "That is helpful. What would you suggest for a complete beginner?",
    "Could you summarise your answer in two sentences?",
    "Can you write that again in a more formal tone?",
)


GROUNDED = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Read this and answer: what is it about, and who would need it?\n\n{text}",
    "Rewrite the following in plain, simple English.\n\n{text}",
    "List the key points of this text as bullet points.\n\n{text}",
)
CODE = (
    "Explain what this Python code does, step by step.\n\n```python\n{text}\n```",
    "Add comments to this Python code and return the whole code.\n\n```python\n{text}\n```",
    "Suggest improvements to this Python code.\n\n```python\n{text}\n```",
)
LOCAL_OPEN = (
    "Explain {topic} to a beginner.",
    "Give me three practical tips related to {topic}.",
    "What are common mistakes people make with {topic}?",
)
ARITHMETIC = (
    "A box holds {a} apples and {b} more are added each day for {c} days. How many apples "
    "are there at the end? Show your reasoning.",
    "Compute {a} * {b} - {c} and explain each step.",
    "If a train travels {a} km in {b} hours, what is its average speed? Think step by step.",
    "A bakery sells {a} cakes a day at {b} dollars each. How much does it earn in {c} days? "
    "Explain your steps.",
    "Sara is {b} years old and her uncle is {a} years older. How old will her uncle be in {c} "
    "years? Show the working.",
    "A garden is {a} metres long and {b} metres wide. What is its area, and how many metres of "
    "fence go around it?",
    "{a} students share {c} boxes of {b} crayons equally. How many crayons does each student "
    "get, and how many are left over?",
    "A jacket costs {a} dollars and is sold at {c} percent off. What is the new price? Explain.",
    "A tank fills at {b} litres per minute. How long does it take to fill {a} litres? Give the "
    "answer in minutes and seconds.",
    "Solve for x: {b}x + {c} = {a}. Show each step.",
)

Chat = tuple[str, ...]  # a conversation's user turns; the target answers each in turn


def chat_prompts(snippets: list[Snippet], count: int, rng: random.Random) -> list[Chat]:
    """``count`` conversations: one user message each (one template, at random), some of the
    open-ended ones with a follow-up question after the target's first answer."""
    prompts: list[Chat] = []
    for i in range(count):
        snippet = snippets[i % len(snippets)]
        roll = rng.random()
        if roll < 0.12:
            a, b, c = rng.randint(2, 99), rng.randint(2, 30), rng.randint(2, 20)
            first = rng.choice(ARITHMETIC).format(a=a, b=b, c=c)
        elif roll < 0.45:
            first = rng.choice(OPEN_PROMPTS).format(s=rng.choice(SUBJECTS))
        elif roll < 0.62:
            who, other = rng.sample(CHARACTERS, 2)
            first = rng.choice(STORY_PROMPTS).format(
                c=who, c2=other, e=rng.choice(EVENTS), s=rng.choice(SUBJECTS)
            )
        elif roll < 0.68:
            first = rng.choice(LOCAL_OPEN).format(topic=snippet.topic)
        else:
            templates = CODE if snippet.is_code else GROUNDED
            prompts.append((rng.choice(templates).format(text=snippet.text),))
            continue
        if rng.random() < FOLLOW_UP_SHARE:
            prompts.append((first, rng.choice(FOLLOW_UPS)))
        else:
            prompts.append((first,))
    return prompts
