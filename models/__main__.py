"""`python -m models`: print the GPT size presets with their parameter counts."""

from models.presets import preset_table

if __name__ == "__main__":
  print(preset_table())
