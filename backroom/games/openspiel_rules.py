"""Short rules of the OpenSpiel games backroom checked in lockstep, for LLM prompts.

OpenSpiel documents its games in C++ comments, not in the game object, so a
prompt has only the game's long name to go on. For the games listed here the
prompt opens with these few sentences instead; ``{players}`` and the game's
parameters (``{num_cards}``, ``{coins}``, ...) are filled in from the game as
loaded. Each text says how OpenSpiel writes the state, since the prompt shows
the state in OpenSpiel's own strings.
"""

from __future__ import annotations

_MATRIX = (
    "You are playing a one-shot two-player matrix game ({title}): both players "
    "choose at the same time, without seeing the other's choice, and are paid "
    "by the pair of choices. {payoffs}"
)

RULES: dict[str, str] = {
    "kuhn_poker": (
        "You are playing Kuhn poker with {players} players and one card more than "
        "players, numbered from 0; the highest card wins. Everyone antes 1 chip and gets one "
        "card. On your turn you may Pass or Bet 1 chip; after a bet, each other player "
        "either calls it (Bet) or folds (Pass). OpenSpiel writes your state as your "
        "card followed by the moves so far (p: pass, b: bet)."
    ),
    "leduc_poker": (
        "You are playing Leduc poker with {players} players. The deck has two suits "
        "of one rank more than there are players; each player antes 1 chip and gets one private card. "
        "There are two betting rounds; after the first, one public card is turned up. "
        "Bets are 2 chips in round 1 and 4 in round 2, with at most two raises per "
        "round. A player who pairs the public card wins; otherwise the higher private "
        "card wins. On your turn you may Fold, Call (or check) or Raise. OpenSpiel "
        "writes your private card, the public card, the pot, each player's money and "
        "the moves of each round (0: fold, 1: call, 2: raise)."
    ),
    "liars_dice": (
        "You are playing Liar's Dice with {players} players, {numdice} die each with "
        "{dice_sides} sides; you see only your own dice. Players take turns bidding "
        "'q-f': at least q dice among all players show face f (the highest face counts "
        "as any face). Each bid must be higher than the last. Instead of bidding you "
        "may call Liar: if the last bid is true the caller loses, otherwise the bidder "
        "loses. OpenSpiel writes your dice, then the bids so far."
    ),
    "goofspiel": (
        "You are playing Goofspiel with {players} players and cards 1 to {num_cards}. "
        "Each turn a prize card is revealed and every player bids one of their own "
        "remaining cards at the same time; the highest bid wins the prize's points "
        "(ties: nobody wins it). Bid cards are used up. The player with the most "
        "points wins."
    ),
    "tic_tac_toe": (
        "You are playing tic-tac-toe: player 0 places x, player 1 places o, on a 3x3 "
        "board; three in a row (across, down or diagonally) wins. An action x(r,c) "
        "marks row r, column c (counted from 0). The board is shown with '.' for empty."
    ),
    "connect_four": (
        "You are playing Connect Four on a {rows}x{columns} board: player 0 drops x "
        "and player 1 drops o into a column (x0, o3: column 0, column 3); the piece "
        "falls to the lowest empty row. {x_in_row} in a row (across, down or "
        "diagonally) wins. The board is shown top row first, '.' for empty."
    ),
    "matrix_pd": _MATRIX.format(
        title="the prisoner's dilemma",
        payoffs="Both Cooperate: 5 each. Both Defect: 1 each. One defects against a "
        "cooperator: the defector gets 10, the cooperator 0.",
    ),
    "matrix_mp": _MATRIX.format(
        title="matching pennies",
        payoffs="Player 0 wins 1 from player 1 if the choices match, and loses 1 if not.",
    ),
    "matrix_rps": _MATRIX.format(
        title="rock, paper, scissors",
        payoffs="Rock beats Scissors, Scissors beat Paper, Paper beats Rock: the "
        "winner gets 1 and the loser -1; a tie pays 0.",
    ),
    "first_sealed_auction": (
        "You are playing a first-price sealed-bid auction with {players} players. "
        "Chance gives each player a private value for the item, from 1 to "
        "{max_value}. Each player then bids once, not seeing the others' bids, at "
        "most their value. The highest bid wins the item and pays its bid (ties are "
        "broken at random); the winner's return is value minus bid, everyone else's 0."
    ),
    "oshi_zumo": (
        "You are playing Oshi-Zumo: two players each start with {coins} coins and a "
        "wrestler (W) stands in the middle of a field of {size} squares either side. "
        "Every turn both players bid coins at the same time (at least {min_bid}); the "
        "higher bid pushes the wrestler one square toward the other player's edge "
        "(player 0 pushes right), and bids are spent. Push the wrestler off the "
        "other's edge to win; when no one can bid or {horizon} turns pass, whoever "
        "the wrestler stands further from wins, and a wrestler in the middle is a draw."
    ),
    "blotto": (
        "You are playing Colonel Blotto with {players} players: each player spreads "
        "{coins} coins over {fields} battlefields at the same time, written [a,b,c]. "
        "Whoever puts the most coins on a field wins it; the player who wins the most "
        "fields wins the game."
    ),
    "bargaining": (
        "You are playing a negotiation game: two players divide a pool of books, hats "
        "and basketballs. Each values the items differently and sees only their own "
        "values. Players take turns making an offer (how many of each item the offerer "
        "keeps) or accepting the other's last offer; with no agreement after "
        "{max_turns} offers, both get nothing. Your return is the value of what you keep."
    ),
    "hearts": (
        "You are playing Hearts with 4 players (N, E, S, W). After passing cards, "
        "players play tricks: follow the led suit if you can; the highest card of "
        "the led suit takes the trick. Each heart taken costs 1 point and the queen "
        "of spades 13. Fewer points is better. Cards are written rank then suit "
        "(QS: queen of spades, TC: ten of clubs)."
    ),
}
