"""The easyvqa task's functions (lmms-eval imports them through the YAML's !function tags).

An item is a row of configs/vlm/data/vqa.parquet: id, image (PNG bytes), question, answer,
choices (the 13 answers easy-vqa has), label.
"""

import io

from PIL import Image


def doc_to_visual(doc):
    """The item's images, as PIL images: here its one PNG."""
    return [Image.open(io.BytesIO(doc["image"])).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    """The question, between the prompts the YAML gives for the model (its default here)."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def process_results(doc, results):
    """One value per metric of the YAML's metric_list for this item; lmms-eval averages them."""
    answer = results[0].strip().lower()
    return {"exact_match": float(answer == doc["answer"]),
            "valid_answer": float(answer in doc["choices"])}
