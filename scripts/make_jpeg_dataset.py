"""Write a synthetic ImageFolder of real JPEG files, for trying prefetchd without a dataset.

python scripts/make_jpeg_dataset.py /tmp/fake-imagenet --classes 10 --per-class 100 --min 300 --max 500
"""

import argparse

from prefetchd.cli.datagen import make_image_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--min", type=int, default=300, help="smallest side length in pixels")
    parser.add_argument("--max", type=int, default=500, help="largest side length in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_image_folder(args.root, args.classes, args.per_class, (args.min, args.max), args.seed)
    print(f"wrote {args.classes * args.per_class} JPEGs under {args.root}")


if __name__ == "__main__":
    main()
