"""A two-turn guessing game with feedback: the environment of recipes/quickstart_agent.yaml.

The secret is the data row's label (a string of the data set's symbols; one
symbol in the quick start); the model never sees it. It guesses, and the
environment answers position by position: `=` where the guess was right, the
secret's symbol where it was not. The model's second turn is scored by the
share of positions it gets right; a first guess that is right in full scores
1 at once.

    user: ?            assistant: ab        (secret "cb")
    user: c=           assistant: cb        reward 1.0

Nothing in the first turn can be learned (the secret is random), so the
reward rises only if the model learns to read the feedback in its context and
to repeat its own earlier symbol where the feedback says `=`.
"""

from relax_core.rollout.envs import Environment


class GuessEnv(Environment):
    def __init__(self, prompt: str = "?"):
        self.prompt = prompt
        self.secret = ""
        self.turn = 0

    def reset(self, sample):
        self.secret, self.turn = str(sample["label"]), 0
        return self.prompt

    def step(self, response):
        self.turn += 1
        guess = response.strip()[: len(self.secret)]
        right = sum(g == s for g, s in zip(guess, self.secret))
        if self.turn == 1 and guess == self.secret:
            return None, 1.0, True, {"first_guess_right": 1}
        if self.turn == 1:
            feedback = "".join("=" if g == s else s for g, s in zip(guess.ljust(len(self.secret)), self.secret))
            return feedback, 0.0, False, {"first_guess_right": 0}
        return None, right / len(self.secret), True, {}
