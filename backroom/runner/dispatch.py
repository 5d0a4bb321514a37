"""The ``MatchLedger``, where ``backroom run`` and its readers imported it from before it moved
to ``backroom.play.ledger`` (the one way every caller plays a batch of matches)."""

from backroom.play.ledger import AGAIN_TRIES as AGAIN_TRIES
from backroom.play.ledger import EPISODE_WAIT_S as EPISODE_WAIT_S
from backroom.play.ledger import REFEREE_GRACE_S as REFEREE_GRACE_S
from backroom.play.ledger import RERUNS as RERUNS
from backroom.play.ledger import MatchLedger as MatchLedger
from backroom.play.ledger import feed_acks as feed_acks
