"""Generate the bundled demo chat dataset, deterministically.

Out: ``ds_capture/demo_data/conversations.jsonl`` (or the path given), one OpenAI-format
conversation per line: ``{"messages": [{"role", "content", optional "reasoning_content"}]}``.
The text is seeded templating over small phrase banks: plausible English, not facts. The mix
(system prompts, reasoning, tool turns, long rows, 1-6 turns) is what the tests promise.

Run: python tools/make_demo_conversations.py [--out PATH] [--num-rows 300] [--seed 1234]
"""

import argparse
import json
import random
from pathlib import Path

OUT_DEFAULT = Path(__file__).resolve().parents[1] / "ds_capture" / "demo_data" / "conversations.jsonl"

# topic -> (subjects, question templates, answer sentences); "{s}" is the subject.
TOPICS = {
    "code": (
        ["a Python list comprehension", "a binary search", "a REST endpoint", "a unit test",
         "a SQL join", "a memory leak", "a race condition", "a recursive function", "a regex"],
        ["How do I write {s}?", "Can you explain {s} with an example?", "Why does {s} fail here?",
         "What is the cleanest way to debug {s}?", "Review {s} I wrote yesterday, please."],
        ["Start by writing down the inputs and the expected output of {s}.",
         "A small example usually shows where {s} goes wrong.",
         "Keep the function short and give every variable a clear name.",
         "Add a test that fails first, then change the code until it passes.",
         "Print the intermediate values, or better, step through them in a debugger.",
         "The edge cases are an empty input, a single element and very large values.",
         "Here is a sketch: `def solve(items): return [x * 2 for x in items if x > 0]`.",
         "Measure before optimising; the slow part is rarely where you expect it.",
         "Once it works, read it again tomorrow and simplify what you can."],
    ),
    "math": (
        ["a quadratic equation", "the area of a circle", "a geometric series", "a derivative",
         "a probability puzzle", "prime factorisation", "a system of two equations", "an integral"],
        ["How do I solve {s}?", "Can you walk me through {s}?", "What is the trick behind {s}?",
         "My answer for {s} looks wrong, can you check it?"],
        ["First write {s} in its standard form so the structure is visible.",
         "Substitute a simple value to check that each step still holds.",
         "For example, 3 x 4 = 12 and 12 / 4 = 3, so the inverse step recovers the input.",
         "The key identity is that the sum of the first n odd numbers equals n squared.",
         "Keep track of the signs; most mistakes happen when a minus sign is dropped.",
         "Draw a picture: a sketch often makes the relationship obvious.",
         "The result should be checked against an estimate of its size.",
         "If two methods give the same answer, you can be fairly confident in it."],
    ),
    "cooking": (
        ["a tomato soup", "fresh pasta", "a sourdough loaf", "a vegetable curry", "pancakes",
         "a lemon tart", "roasted chicken", "a green salad", "risotto"],
        ["What is a simple recipe for {s}?", "How can I make {s} taste better?",
         "Why did my {s} turn out dry?", "Can I prepare {s} the day before?"],
        ["For {s}, good ingredients matter more than complicated technique.",
         "Season a little at a time and taste as you go.",
         "Warm the pan properly before adding the oil, then lower the heat.",
         "Let it rest for ten minutes before serving so the flavours settle.",
         "A squeeze of lemon at the end brightens almost any dish.",
         "If it turns out dry, shorten the cooking time or add a splash of stock.",
         "Chop the onions finely and cook them slowly until they are soft and golden.",
         "Most of the work can be done ahead; finish it just before eating."],
    ),
    "travel": (
        ["a weekend in Lisbon", "a train trip across Japan", "hiking in the Alps", "a week in Mexico City",
         "a road trip in Scotland", "visiting Kyoto in autumn", "a ferry tour of the Greek islands"],
        ["How should I plan {s}?", "What should I pack for {s}?", "Is {s} expensive?",
         "What are the mistakes people make on {s}?"],
        ["For {s}, book the long journeys early and leave the rest flexible.",
         "Pack light layers; the weather changes quickly in the mountains and by the sea.",
         "Local markets are a cheap way to eat well and meet people.",
         "Public transport is usually faster than a car in the old city centres.",
         "Keep a copy of your documents separate from the originals.",
         "Plan one quiet day; trips that are too full become tiring.",
         "Learn a few polite phrases in the local language; people appreciate the effort.",
         "Check the opening days of museums, many close on Mondays."],
    ),
    "history": (
        ["the Roman roads", "the printing press", "the Silk Road", "the industrial revolution",
         "medieval castles", "the first maps of the world", "ancient Egyptian writing"],
        ["Why was {s} so important?", "Tell me briefly about {s}.", "What changed because of {s}?",
         "How do historians know about {s}?"],
        ["{s} changed how people moved goods, ideas and news.",
         "Historians rely on letters, records, coins and buildings that survived.",
         "The change was slow at first and then spread within a few generations.",
         "Trade brought new foods, tools and languages to distant places.",
         "Many details are still debated, because the sources disagree.",
         "Local rulers often paid for the work to show their power.",
         "Much of what we know comes from archaeology rather than written texts."],
    ),
    "science": (
        ["photosynthesis", "black holes", "the water cycle", "vaccines", "plate tectonics",
         "the speed of light", "DNA replication", "climate models"],
        ["Explain {s} in simple words.", "How does {s} actually work?", "What is a common myth about {s}?"],
        ["At its core, {s} is about energy moving from one form to another.",
         "Scientists test an idea by predicting something new and then measuring it.",
         "The simple picture is useful, but the full story has many more steps.",
         "Small effects add up over long times and large distances.",
         "Models are checked against observations again and again.",
         "A good experiment changes one thing at a time."],
    ),
    "writing": (
        ["a cover letter", "a short story opening", "a product description", "a wedding toast",
         "an apology email", "a project summary"],
        ["Can you help me write {s}?", "How do I make {s} more engaging?", "What should {s} include?"],
        ["Open {s} with one concrete detail rather than a general statement.",
         "Short sentences keep the reader moving.",
         "Cut every word that does not add meaning.",
         "End with a clear next step or a memorable image.",
         "Read it aloud; awkward phrases become obvious.",
         "Write for one specific reader, not for everyone."],
    ),
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a friendly tutor who explains things step by step.",
    "You are an expert assistant. Be precise and mention caveats.",
    "You are a travel and cooking guide with a warm tone.",
    "You are a senior software engineer reviewing code for a colleague.",
]

FOLLOW_UPS = [
    "Thanks. Can you give me a shorter version?", "Could you add an example?",
    "What would you do differently?", "Why is that the case?", "And what about the edge cases?",
    "That helps. Anything else I should know?", "Can you explain the second point again?",
]

REASONING = [
    "The user asks about {s}. I should start from the basics.",
    "Let me think about what matters most here.",
    "There are two possible readings of the question; the practical one is more likely.",
    "I will give a short answer first and then the details.",
    "An example will make this clearer than a definition.",
    "I should check the numbers before I answer.",
]

# (user question, tool name, call arguments, tool result, assistant reply); "{city}", "{n}" are filled in.
TOOLS = [
    ("What is the weather like in {city} today?", "get_weather", '{{"city": "{city}"}}',
     '{{"city": "{city}", "temp_c": {n}, "sky": "cloudy"}}', "It is {n} degrees and cloudy in {city} right now."),
    ("Find me a dinner recipe popular in {city}.", "search_recipes", '{{"query": "{city} dinner"}}',
     '{{"results": ["stew", "flatbread", "salad"]}}', "I found three ideas from {city}: a stew, flatbread and a salad."),
    ("How much is {n} dollars in euros?", "convert_currency", '{{"amount": {n}, "to": "EUR"}}',
     '{{"amount_eur": {n}.5}}', "{n} dollars is about {n}.5 euros at today's rate."),
]
CITIES = ["Lisbon", "Kyoto", "Oslo", "Lima", "Nairobi", "Hanoi", "Denver"]


def write_answer(rng: random.Random, sentences: list[str], subject: str, num_sentences: int) -> str:
    """Join ``num_sentences`` sentences drawn from the bank into paragraphs of 2-5 sentences."""
    # Draw without replacement, reshuffling the bank when it runs out, so sentences rarely repeat.
    picked = []
    while len(picked) < num_sentences:
        picked += rng.sample(sentences, k=min(len(sentences), num_sentences - len(picked)))
    picked = [s.replace("{s}", subject) for s in picked]
    picked = [s[0].upper() + s[1:] for s in picked]
    paragraphs, i = [], 0
    while i < len(picked):
        size = rng.randint(2, 5)
        paragraphs.append(" ".join(picked[i:i + size]))
        i += size
    return "\n\n".join(paragraphs)


def make_conversation(rng: random.Random, index: int) -> dict:
    """One conversation; ``index`` fixes which rows are long / carry tools so the mix is exact."""
    topic = rng.choice(sorted(TOPICS))
    subjects, questions, answers = TOPICS[topic]
    subject = rng.choice(subjects)
    is_long = index % 10 == 3
    has_tool = index % 25 == 7
    has_reasoning = index % 5 == 1
    messages = []
    if index % 3 == 0:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choices(range(1, 7), weights=[45, 20, 15, 10, 5, 5])[0]
    for turn in range(num_turns):
        question = rng.choice(questions).replace("{s}", subject) if turn == 0 else rng.choice(FOLLOW_UPS)
        if has_tool and turn == 0:
            ask, name, args, result, reply = rng.choice(TOOLS)
            fill = {"city": rng.choice(CITIES), "n": rng.randint(3, 40)}
            messages.append({"role": "user", "content": ask.format(**fill)})
            messages.append({"role": "assistant", "content": f"<tool_call>{name}({args.format(**fill)})</tool_call>"})
            # The call is in the assistant's text (Hermes style); NeMo requires the reply's tool_call_id.
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": result.format(**fill)})
            messages.append({"role": "assistant", "content": reply.format(**fill)})
            continue
        messages.append({"role": "user", "content": question})
        num_sentences = rng.randint(28, 40) // num_turns + 2 if is_long else rng.randint(1, 3)
        message = {"role": "assistant", "content": write_answer(rng, answers, subject, num_sentences)}
        if has_reasoning and turn == num_turns - 1:
            steps = rng.sample(REASONING, k=rng.randint(2, 4))
            message["reasoning_content"] = " ".join(step.replace("{s}", subject) for step in steps)
        messages.append(message)
    if is_long:
        # Long rows must exceed 2000 characters (and 512 demo tokens) so seq_length 512 truncates them.
        while sum(len(m["content"]) for m in messages) <= 2800:
            messages[-1]["content"] += "\n\n" + write_answer(rng, answers, subject, 6)
    return {"messages": messages}


def render_conversations(num_rows: int, seed: int) -> str:
    """The whole JSONL text: ``num_rows`` conversations from one seeded generator."""
    rng = random.Random(seed)
    lines = [json.dumps(make_conversation(rng, i), ensure_ascii=False) for i in range(num_rows)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DEFAULT)
    parser.add_argument("--num-rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_conversations(args.num_rows, args.seed), encoding="utf-8")
    print(f"wrote {args.num_rows} conversations to {args.out}")


if __name__ == "__main__":
    main()
