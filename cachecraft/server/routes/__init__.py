"""The app's routes, one APIRouter per group: completions (chat, text, responses), models and
tokens, chunks, operations (health, version, metrics)."""
