"""Helpers shared by tests in several folders (tests/ is on the path through its conftest)."""

from PIL import Image

from dohnuts.schema import parse_request


def state_of_tokens(template, tokens: int) -> str:
    """A text state whose rendered beginning "State: ...\\n" is exactly `tokens` long."""
    for repeats in range(200):
        for tail in ("", ".", "!?", " ."):
            state = "ok " * repeats + tail
            if len(template.tokenizer(f"State: {state}\n", add_special_tokens=False)["input_ids"]) == tokens:
                return state
    raise AssertionError(f"no state renders to {tokens} tokens")


def encoded(template, request, max_tokens=4096, images=None):
    """(rows, images) of a validated request: each distinct image encoded once, appended to
    `images` (a new list when None), the rows indexing that list."""
    images = [] if images is None else images
    indices = template.encode_images(request, images)
    return template.encode(request, max_tokens, indices, images), images


def batch_of(template, requests):
    """A host batch of (state, questions) requests, each with its own encoded images."""
    rows, images = [], []
    for state, questions in requests:
        request = parse_request(state, questions, template.reserved)
        indices = template.encode_images(request, images, {})
        rows += template.encode(request, 4096, indices, images)
    return template.collate(rows, images)


def questions(count, candidates=3, words=1):
    return {f"q{index}": {"type": "choice", "instructions": "Which one fits? " * words,
                          "criteria": [f"option {c}" for c in range(candidates)]} for index in range(count)}


def square_image(colour):
    image = Image.new("RGB", (64, 64), "white")
    image.paste(colour, (8, 8, 40, 40))
    return image


def saved_pictures(folder):
    """Three pictures of a coloured square on white, of three heights, saved as folder/0.png..2.png."""
    pictures = []
    for index, colour in enumerate([(220, 20, 20), (20, 220, 20), (20, 20, 220)]):
        image = Image.new("RGB", (64, 48 + 16 * index), "white")
        image.paste(colour, (8, 8, 40, 40))
        image.save(folder / f"{index}.png")
        pictures.append(image)
    return pictures


LAYOUTS = {
    "shared prefix": [({"note": "a long note about a parcel " * 12}, questions(3))],
    "no prefix (one question)": [("short", questions(1))],
    "image and text requests": [({"note": "a square " * 20, "image": square_image((200, 30, 30))}, questions(2)),
                                ("another short state", questions(2, candidates=5))],
    "long rows": [("a state of many words " * 10, questions(1, words=12))],
    "one long row": [("a state of many more words " * 60, questions(1))],  # a one-row bucket's
}


def relative_error(have, truth) -> float:
    """The largest difference of `have` from `truth`, relative to truth's largest magnitude
    (compared in float64 on the host)."""
    truth = truth.detach().double().cpu()
    return ((have.detach().double().cpu() - truth).abs().max() / truth.abs().max().clamp_min(1e-12)).item()


def errs_like(have, reference, truth, floor=1e-2) -> bool:
    """A bf16 fast path held to the float64 `truth` of the same model and input: it may err at
    most twice what the plain bf16 `reference` path errs, plus `floor` (of truth's largest
    magnitude). Two bf16 paths of a tiny random model differ by about as much as each errs, so
    comparing them with each other fails on rounding alone; a wrong result errs by the
    truth's own size."""
    return relative_error(have, truth) <= 2 * relative_error(reference, truth) + floor


class SpiedKernel:
    """A Triton kernel's launcher that records each launch's positional arguments (`calls`) and
    launches it: a test can tell which variant ran (a constexpr among the arguments)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(args)
            return self.kernel[grid](*args, **options)
        return launch

