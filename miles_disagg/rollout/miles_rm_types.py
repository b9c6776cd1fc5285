"""miles' ``--rm-type`` rewards that need no network, with miles' meanings (``miles.rollout.rm_hub``).

Each is miles' form, ``async def reward(args, sample) -> value``; the value is what miles' rm_hub
returns (``dapo`` a dict ``{"score", "acc", "pred"}``: read it with ``--reward-key score``).

* ``dapo``     - the text after the last ``Answer:`` in the response's last 300 characters,
  normalized (DAPO's normalization: units and TeX spacing dropped, ``=`` takes the right side)
  and compared with the label as an integer when the label is one: ``score`` 1.0 / -1.0.
* ``f1``       - word-level F1 of the response against the label (lower case, punctuation and
  articles dropped; a yes/no/noanswer mismatch scores 0).
* ``gpqa``     - multiple choice: the option letter the response picks (after ``</think>``)
  against the label's letter (a letter, an index, or the text of a choice in
  ``metadata["choices"]``; ``metadata["correct_letter"]`` wins); 1.0 or 0.0.
* ``random``   - 0 or 1 at random.
* ``boxed_<type>`` - ``<type>`` scored on the response's last ``\\boxed{...}`` only.

``math`` and ``deepscaler`` are this project's rule rewards (``answer_scoring.py``). A sample's
``metadata["rm_type"]`` picks its type, as in miles. ``remote_rm``, ``ocr``, ``pickscore`` and
``ifbench`` are refused with the reason (:data:`REFUSED_RM_TYPES`).
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from types import SimpleNamespace
from typing import Any

from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.answer_scoring import answers_match, deepscaler_reward, label_answers, last_boxed, math_reward

REFUSED_RM_TYPES = {
    "remote_rm": "it posts each sample to an external reward server (--rm-url), which this launcher does not "
                 "reach; put the call in an async --custom-rm-path reward_func(args, sample) instead",
    "ocr": "it scores images with an OCR model, which this project does not include; use --custom-rm-path",
    "pickscore": "it scores images with a PickScore reward model, which this project does not include; "
                 "use --custom-rm-path",
    "ifbench": "it scores with AllenAI's IFBench checker library, which miles clones from GitHub and installs "
               "at first use (the network) and this project does not include; install IFBench and call its "
               "checker from an async --custom-rm-path",
}

DAPO_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
              "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
              "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
              "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
              r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")


def dapo_normalize(answer: str) -> str:
    """DAPO's normalization of a final answer (the right side of its last ``=``)."""
    text = str(answer).split("=")[-1]
    for old, new in _DAPO_REPLACE:
        text = text.replace(old, new)
    for word in _DAPO_DROP:
        text = text.replace(word, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", text)
    for command in ("text", "textbf", "overline"):
        text = re.sub(r"(\\" + command + r"\{)(.*?)(\})", r"\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", text)
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text).replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_score(response: str, label: Any) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` (miles' ``dapo``)."""
    found = _ANSWER_LINE.findall(str(response)[-DAPO_TAIL_CHARS:])
    pred = dapo_normalize(found[-1] if found else "[INVALID]")
    gold = dapo_normalize(label)
    try:
        gold = str(int(float(gold)))
    except (ValueError, OverflowError):
        pass
    correct = pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _f1_words(text: str) -> list[str]:
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_score(prediction: str | None, truth: str) -> tuple[float, float, float]:
    """``(f1, precision, recall)`` over normalized words (miles' ``f1``; its reward is the first)."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred, gold = _f1_words(prediction), _f1_words(truth)
    special = {"yes", "no", "noanswer"}
    if (" ".join(pred) in special or " ".join(gold) in special) and pred != gold:
        return 0.0, 0.0, 0.0
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall), precision, recall


_LETTER_PATTERNS = (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
                    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])")


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def gpqa_reward(response: str, label: Any, metadata: dict | None) -> float:
    """1.0 if the response picks the right option (miles' ``gpqa``), else 0.0."""
    metadata = metadata or {}
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = [str(x).upper() for x in metadata.get("valid_letters") or []] or \
        list(string.ascii_uppercase[:len(choices) or 10])
    text = str(response or "").rsplit("</think>", 1)[-1]
    correct = _correct_letter(label, metadata, choices, letters)
    picked = _picked_letter(text, letters)
    if picked and correct:
        return 1.0 if picked == correct else 0.0
    index = letters.index(correct) if correct in letters else len(choices)
    targets = [str(choices[index])] if index < len(choices) else []
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if isinstance(label, str) and not (len(label.strip()) == 1 and label.strip().upper() in letters):
        targets.append(label)
    padded = f" {_words(text)} "
    return 1.0 if any(_words(t) and f" {_words(t)} " in padded for t in targets) else 0.0


def _correct_letter(label: Any, metadata: dict, choices: list, letters: list[str]) -> str | None:
    given = metadata.get("correct_letter")
    if isinstance(given, str) and given.strip():
        return given.strip().upper()
    if isinstance(label, str) and len(label.strip()) == 1 and label.strip().upper() in letters:
        return label.strip().upper()
    if isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
        return letters[int(label)]
    if isinstance(label, str):
        for index, choice in enumerate(choices):
            if _words(choice) == _words(label) and index < len(letters):
                return letters[index]
    return None


def _picked_letter(text: str, letters: list[str]) -> str | None:
    for pattern in _LETTER_PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in letters:
            return letter
    return None


def score_rm_type(rm_type: str, response: str, label: Any, metadata: dict) -> Any:
    """miles' value of ``rm_type`` for one response (``ValueError`` for a type that is not here)."""
    boxed = rm_type.startswith("boxed_")
    if boxed:
        response, rm_type = last_boxed(response) or "", rm_type[len("boxed_"):]
        if rm_type in ("math", "deepscaler"):  # the box's content is the answer
            return 1.0 if response and any(answers_match(response, gold) for gold in label_answers(label)) else 0.0
    if rm_type in REFUSED_RM_TYPES:
        raise ValueError(f"--rm-type {rm_type} is a miles reward that does not apply here: "
                         f"{REFUSED_RM_TYPES[rm_type]}")
    if rm_type == "dapo":
        return dapo_score(response, label)
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "gpqa":
        return gpqa_reward(response, label, metadata)
    if rm_type == "random":
        return random.randint(0, 1)
    if rm_type == "math":
        return math_reward("", response, label, metadata)
    if rm_type == "deepscaler":
        return deepscaler_reward("", response, label, metadata)
    raise ValueError(f"--rm-type {rm_type!r} is unknown; known: {sorted(MILES_RM_TYPES)} (and boxed_<type>)")


MILES_RM_TYPES = ("dapo", "f1", "gpqa", "random", "math", "deepscaler")


def is_miles_rm_type(rm_type: str | None) -> bool:
    """``rm_type`` is scored here (miles' names, a ``boxed_`` prefix allowed) rather than by the reward registry's own ``math`` / ``deepscaler``."""
    if not rm_type:
        return False
    base = rm_type[len("boxed_"):] if rm_type.startswith("boxed_") else rm_type
    return base in MILES_RM_TYPES + tuple(REFUSED_RM_TYPES) and base not in ("math", "deepscaler") \
        or rm_type.startswith("boxed_")


async def async_rm(args: Any, sample: Any, default_rm_type: str | None = None, **kwargs: Any) -> Any:
    """miles' ``async_rm``: the sample's ``metadata["rm_type"]``, else ``args.rm_type`` (else
    ``default_rm_type``), scored; ``GenerationFailed`` for a type that is not scored here."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = str(metadata.get("rm_type") or getattr(args, "rm_type", None) or default_rm_type or "").strip()
    if not rm_type:
        raise GenerationFailed("no reward type: give --rm-type or metadata['rm_type']")
    try:
        return score_rm_type(rm_type, sample.response, sample.label, metadata)
    except ValueError as exc:
        raise GenerationFailed(str(exc)) from None


def rm_type_reward(rm_type: str):
    """``--rm-type rm_type`` as miles' reward form (a sample's ``metadata["rm_type"]`` still wins)."""

    async def reward(args: Any, sample: Any, **kwargs: Any) -> Any:
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        return await async_rm(SimpleNamespace(rm_type=metadata.get("rm_type") or rm_type), sample)

    reward.__name__ = f"rm_type_{rm_type}"
    return reward
