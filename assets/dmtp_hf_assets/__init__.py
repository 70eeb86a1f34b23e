"""dmtp-hf's repository assets: the bundled toy models and tiny real-layout test targets (not the library).

``MODELS_DIR`` holds the bundled checkpoints (``dmtp_hf.bundled.default_paths`` finds them here);
``dmtp_hf_assets.tiny_targets`` builds tiny random targets of every supported family in their real checkpoint layout
(it imports torch; this module does not).
"""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"

__all__ = ["MODELS_DIR"]
