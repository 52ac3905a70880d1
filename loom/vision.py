"""The image component of a text deployment: images projected into the decoder's input.

A text document may carry ``"components": {"image": {"sources": [...], "checkpoint": ...}}``:
a package of its own (models/smolvlm/vision.loom: SmolVLM's vision tower and connector) on
its own checkpoint, prepared, checked and proven with the deployment, whose parameters
are their own residency component ("image", beside "primary").

Its stage contract:

    project(tiles, features, N)
        tiles: float32 [N, CH, TILE, TILE], preprocessed tiles of one or more images;
        features: float32 [N * SEQ, TEXT_D], each tile's rows of language-model input.

specs CH, TILE, SEQ (positions per tile) and TEXT_D, which must equal the primary
package's embedding width D. The primary package then needs the stage

    advance_media(tokens, pos, row_of, pages, last, features, feature_at, logits, T, R)

advance with rows of `features` (float32 [*, D]) as the inputs of the positions t
where feature_at[t] >= 0 (int32 [T]; -1 keeps the token's embedding).
"""

import numpy as np

from . import kinds
from .errors import Problem

STAGE = "project"
MEDIA_STAGE = "advance_media"     # the primary package's way in for features


class ImageInput(kinds.Component):
    probes = [(STAGE, {"N": 1})]
    inputs = ("image",)

    def trial(self, binding, command, geometry):
        s, n = binding.specs, geometry["N"]
        return ({"tiles": np.zeros(n * s["CH"] * s["TILE"] * s["TILE"], np.float32)},
                {"features": (np.float32, n * s["SEQ"] * s["TEXT_D"])})

    def check(self, primary, component):
        if MEDIA_STAGE not in {c.name for c in primary.module.commands}:
            raise Problem(f"the text package has no {MEDIA_STAGE!r} command to take image features", "contract")
        commands = {c.name for c in component.module.commands}
        if STAGE not in commands:
            raise Problem(f"the image component's package has no {STAGE!r} command (it has: "
                          f"{', '.join(sorted(commands)) or 'none'})", "contract")
        missing = [name for name in ("CH", "TILE", "SEQ", "TEXT_D") if component.spec(name) is None]
        if missing:
            raise Problem(f"the image component's package lacks the specs {', '.join(missing)}", "contract")
        width, expected = component.spec("TEXT_D"), primary.spec("D")
        if width != expected:
            raise Problem(f"the image component projects to {width} channels; the text model's embeddings "
                          f"have {expected}", "contract")


IMAGE = ImageInput()
