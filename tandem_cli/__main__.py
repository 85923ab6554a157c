from tandem_cli.main import main

main()
