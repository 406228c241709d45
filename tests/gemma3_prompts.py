"""Prompts for the Gemma 3 270M correctness test: short completions of several kinds and three
documents built from original paragraphs, of about 250, 560 and 1100 tokens (the last two
longer than the 512-token sliding window)."""

PARAGRAPHS = [
    "The history of bread is closely tied to the history of agriculture. Long before people "
    "planted fields of wheat, they gathered wild grains, crushed them between stones and mixed "
    "the flour with water. The first flatbreads were baked on hot rocks or in the ashes of a "
    "fire. When farming spread across the river valleys of the Near East, grain became a "
    "reliable source of food, and bread became part of daily life. Bakers later discovered that "
    "dough left to rest would rise, because wild yeasts in the air fed on the sugars in the "
    "flour and released small bubbles of gas. Leavened bread was lighter and kept longer, and "
    "it soon became a symbol of hospitality in many cultures.",
    "A modern city depends on systems that most residents never see. Beneath the streets run "
    "pipes that carry clean water in and waste water out, cables that bring electricity and "
    "data, and tunnels for trains that move millions of people every day. Engineers plan these "
    "networks decades in advance, because digging up a busy road is expensive and disruptive. "
    "They must also plan for growth: a neighbourhood built for a few thousand people may one day "
    "hold ten times as many. Good infrastructure is rarely noticed when it works, yet a single "
    "broken water main can close a district for a week.",
    "Learning to play a musical instrument changes the way the brain processes sound. Beginners "
    "hear a melody as a single stream, but with practice they learn to separate rhythm, pitch "
    "and harmony, and to anticipate where a phrase is going. Teachers often recommend short "
    "daily sessions rather than long weekly ones, since the skills involved are built through "
    "repetition and sleep helps to consolidate them. Many adults who start late find that "
    "their progress is slower at first, but their patience and ability to practise "
    "deliberately often make up for it.",
    "The ocean covers more than seventy percent of the surface of the Earth, yet most of it "
    "remains unexplored. Sunlight fades quickly with depth, and below a few hundred metres the "
    "water is dark and cold. Animals that live there have adapted in remarkable ways: some "
    "produce their own light, others have enormous eyes to catch the faintest glow, and many "
    "can survive for months without food. Research vessels use remotely operated vehicles to "
    "study these creatures, because the pressure at the bottom of a deep trench would crush an "
    "ordinary submarine.",
    "When software engineers talk about performance, they usually mean one of two things: how "
    "long a single task takes, or how many tasks a system can finish in a given time. These are "
    "latency and throughput, and improving one does not always improve the other. Batching "
    "requests together, for example, lets a server use its hardware more efficiently and "
    "raises throughput, but each request may wait a little longer before it is processed. "
    "Careful measurement is the only reliable guide, since intuition about where time is spent "
    "is very often wrong.",
    "Gardening in a small space requires planning. Tomatoes, beans and herbs grow well in "
    "containers on a balcony, as long as they receive at least six hours of sunlight. The soil "
    "should drain freely, because roots that sit in water will rot. Watering in the early "
    "morning reduces evaporation and gives plants what they need before the heat of the day. "
    "Many gardeners keep a notebook of what they planted and when, so that each season they "
    "can repeat their successes and avoid their mistakes.",
    "The invention of the printing press in the fifteenth century transformed the spread of "
    "knowledge in Europe. Before it, books were copied by hand, a slow and costly process that "
    "limited them to monasteries, universities and wealthy households. Movable metal type made "
    "it possible to produce hundreds of identical copies in the time a scribe needed for one. "
    "Pamphlets, maps and scientific treatises circulated widely, literacy rose, and ideas that "
    "once travelled slowly could now cross a continent in a few months.",
]

SHORT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nimport torch\n\n# Load the dataset",
    "Q: What is the largest planet in the solar system?\nA:",
    "In 1969, Neil Armstrong",
    "List of prime numbers: 2, 3, 5, 7,",
]


def prompt_texts() -> list[str]:
    """The prompts, in test order."""
    return (
        SHORT
        + [
            "\n\n".join(PARAGRAPHS[:2]),  # ~250 tokens
            "\n\n".join(PARAGRAPHS[:5]),  # > 512 tokens: global and sliding layers differ
            "\n\n".join(PARAGRAPHS + PARAGRAPHS[:3]),  # > 1024 tokens: blocks leave the window
        ]
    )
