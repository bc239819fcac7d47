"""Check datasets of our own making: realistic images generated offline, deterministically, in seconds.

The default dataset (scikit-learn's 8x8 digits) is a toy; these have the size and structure of the
usual benchmarks, so that accuracy and timing claims can be checked beyond it without a download:

    glyphs     28x28 grey, 10 classes  MNIST-like: digits from jittered stroke templates, random pen width,
                                       affine (rotation, shear, aspect), blur and noise, white on black
    shapes     32x32 RGB, 10 classes   CIFAR-like: an object shape of random colour, size and rotation on a
                                       cluttered background, with distractor fragments, uneven light and noise
    shapes100  32x32 RGB, 100 classes  CIFAR-100-like: the same pictures, the class also naming the object's
                                       hue band (10 shapes x 10 hues; the background keeps any colour)
    garments   28x28 grey, 10 classes  Fashion-MNIST-like: jittered garment silhouettes with textured fill

Every image is a pure function of (class, rng); the rng of image `index` of class `label` is seeded
with (seed, label, index) alone, so a dataset does not depend on generation order, and the first n
images per class of a larger set are the n of a smaller one. Outlines are drawn at SS times the size
and box-filtered down (anti-aliasing) with PIL, whose own drawing needs no system font. Class lists are
sorted, so that ImageFolder's label (the sorted folder names) is the label here.

    drawing     what every picture is drawn with: masks of polygons and pen strokes, noise, ramps, colours
    glyphs      the handwritten digits          shapes     the objects on clutter (shapes, shapes100)
    garments    the clothing silhouettes        datasets   the four datasets by name, and `generate`
    writers     a dataset as an ImageFolder tree of PNGs, or a preview grid
    difficulty  how hard a dataset is: a linear model's accuracy against a small CNN's
    cli         the command line, `python -m benchmarks.synthetic_images` (see there)
"""
