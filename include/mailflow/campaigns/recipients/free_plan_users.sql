-- Recipients of a scheduled outreach campaign: every user on the free plan.
--
-- A recipient file returns one row per recipient with at least
--   user_id     bigint  unique per row (provisioning pages through it in user_id order)
--   email       text    the address the email goes to (snapshotted on the send-log row)
--   first_name  text    may be null or empty (the layouts greet "there")
-- and any extra columns, which become template variables (user.<column>).
-- Bound parameters available: campaign (its name) and campaign_id, as psycopg named placeholders.
-- The statement runs with parameters: a literal percent sign must be doubled, and placeholders
-- must not appear in comments (they are bound there too).
select u.user_id,
       u.email,
       u.first_name,
       u.signed_up_at
from app.users u
where u.plan = 'free'
