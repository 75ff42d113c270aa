"""Programs and helpers the tests start or import (not tests themselves)."""
