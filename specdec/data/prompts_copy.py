"""Copy-heavy prompts: the ``copy`` dataset of :mod:`specdec.data.datasets` (the ``ngram_vs_prompt_lookup`` preset).

Each prompt hands the model code or prose that a good answer mostly copies back: rename a
variable, add a docstring, swap prints for logging, fix one line, quote-and-summarise, or
repeat a paragraph with one word replaced. That is the regime where prompt lookup shines.
"""

from __future__ import annotations

__all__ = ["PROMPTS"]

_RENAME = '''Here is a Python function. Rename the variable `items` to `line_items` everywhere and return the whole function, unchanged otherwise.

```python
def compute_invoice_total(items, tax_rate, discount=0.0):
    subtotal = 0.0
    for item in items:
        price = item["unit_price"] * item["quantity"]
        if item.get("taxable", True):
            price = price * (1.0 + tax_rate)
        subtotal += price
    if discount > 0.0:
        subtotal = subtotal * (1.0 - discount)
    count = len(items)
    average = subtotal / count if count else 0.0
    return {"total": round(subtotal, 2), "count": count, "average": round(average, 2)}
```'''

_DOCSTRING = '''Repeat this code exactly, but add a Google-style docstring to the function. Return the complete function.

```python
def merge_intervals(intervals, tolerance=0):
    if tolerance < 0:
        raise ValueError("tolerance must be non-negative")
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1] + tolerance:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
```'''

_LOGGING = '''Rewrite the following function so that it uses the `logging` module instead of `print`. Create a module-level `logger = logging.getLogger(__name__)` and keep everything else exactly the same. Return the whole file.

```python
import json
import os


def load_settings(path, defaults=None):
    settings = dict(defaults or {})
    if not os.path.exists(path):
        print(f"settings file {path} not found, using defaults")
        return settings
    with open(path, "r", encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as error:
            print(f"could not parse {path}: {error}")
            return settings
    for key, value in data.items():
        if key not in settings:
            print(f"unknown setting {key!r} ignored")
            continue
        settings[key] = value
    print(f"loaded {len(data)} settings from {path}")
    return settings
```'''

_BUGFIX = '''The function below should return the moving average of `values` over a window of `size`, but it skips the last window. Fix the bug and return the entire corrected function.

```python
def moving_average(values, size):
    if size <= 0:
        raise ValueError("size must be positive")
    if len(values) < size:
        return []
    averages = []
    window_sum = sum(values[:size])
    averages.append(window_sum / size)
    for index in range(size, len(values) - 1):
        window_sum += values[index] - values[index - size]
        averages.append(window_sum / size)
    return averages
```'''

_QUOTE = '''Read the paragraph below. First quote it back word for word inside quotation marks, then summarise it in one sentence.

Paragraph: The city council voted on Tuesday to extend the hours of the central public library, which will now stay open until nine in the evening on weekdays and until six on Saturdays. The change follows a survey in which more than two thousand residents said that the previous closing time of five o'clock made it hard for working adults and students to use the reading rooms, the computer lab and the study spaces. The extra hours will be paid for by moving part of the budget that was set aside for new furniture, and the library will hire four additional part-time staff members to cover the evening shifts. A review of visitor numbers is planned for the end of the year.'''

_REPLACE = '''Repeat the following paragraph exactly, but replace every occurrence of the word "customer" with "client". Do not change anything else.

When a customer contacts the support team, the first agent who answers is responsible for the ticket until it is resolved. The agent should confirm the customer's account number, write a short description of the problem in the ticket, and tell the customer how long a reply is likely to take. If the problem needs a specialist, the agent adds the specialist to the ticket but stays in charge of keeping the customer informed. Every ticket must receive an update at least once every two working days, even if there is no progress to report. When the problem is solved, the agent asks the customer to confirm that everything works before the ticket is closed.'''

PROMPTS: list[str] = [_RENAME, _DOCSTRING, _LOGGING, _BUGFIX, _QUOTE, _REPLACE]
